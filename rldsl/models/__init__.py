"""Models the torch engines run: the builtin tiny-lm and local HF models.

Importing this package does not import torch; ``load_model`` does.
"""

from rldsl.models.tokenizer import CharTokenizer


def load_model(source: str, device="cpu", **options):
    """See ``rldsl.models.tiny.load_model``."""
    from rldsl.models.tiny import load_model as _load_model

    return _load_model(source, device, **options)


def load_tokenizer(source: str):
    """The tokenizer of a model source, without loading its weights."""
    if source.startswith("hf:"):
        from transformers import AutoTokenizer

        from rldsl.models.hf import HFTokenizer

        return HFTokenizer(AutoTokenizer.from_pretrained(source[len("hf:"):], local_files_only=True))
    return CharTokenizer()


__all__ = ["CharTokenizer", "load_model", "load_tokenizer"]
