"""Models the torch engines run: the builtin tiny-lm and local HF models.

Importing this package does not import torch; ``load_model`` does.
"""

from rldsl.models.tokenizer import CharTokenizer


def load_model(source: str, device="cpu", **options):
    """See ``rldsl.models.tiny.load_model``."""
    from rldsl.models.tiny import load_model as _load_model

    return _load_model(source, device, **options)


__all__ = ["CharTokenizer", "load_model"]
