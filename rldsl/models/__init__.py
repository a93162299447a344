"""Models the torch engines run: the builtin tiny-lm and local HF models.

Importing this package does not import torch; ``load_model`` does. The
builtin model's supervised warm start is the torch engines' business
(``rldsl.runtime.engines.torch.warmstart``): a model source knows nothing of
engines.
"""

import functools

from rldsl.models.base import BUILTIN_TINY
from rldsl.models.tokenizer import CharTokenizer


def load_model(source: str, device="cpu", *, seed: int = 0, **options):
    """Load ``builtin:tiny-lm`` (freshly initialised from ``seed``) or
    ``hf:<local path>`` (pretrained; ``seed`` ignored) onto ``device``.
    ``options`` override ``TinyLMConfig`` fields, or reach
    ``rldsl.models.hf.load_hf_model`` (e.g. ``dtype``)."""
    if source == BUILTIN_TINY:
        from rldsl.models.tiny import build_tiny_lm

        return build_tiny_lm(seed, **options).to(device)
    if source.startswith("hf:"):
        from rldsl.models.hf import load_hf_model

        return load_hf_model(source[len("hf:"):], device, **options)
    raise ValueError(f"unknown model source {source!r}: expected {BUILTIN_TINY!r} or 'hf:<local path>'")


def load_tokenizer(source: str):
    """The tokenizer of a model source, without loading its weights."""
    if source.startswith("hf:"):
        from transformers import AutoTokenizer

        from rldsl.models.hf import HFTokenizer

        return HFTokenizer(AutoTokenizer.from_pretrained(source[len("hf:"):], local_files_only=True))
    return CharTokenizer()


@functools.lru_cache(maxsize=8)
def chat_formatter(source: str):
    """``prompt -> text`` through the model's chat template, the assistant's
    turn opened: a string prompt as one user turn, a list of chat messages
    (``{"role", "content"}``) as it is. Only `hf:` models have one; a
    tokenizer without a template is refused rather than silently skipped.
    Cached: the preflight and every dataset load of a run ask for the same
    model's, and a tokenizer takes a while to load."""
    if not source.startswith("hf:"):
        raise ValueError(f"`chat_template = true` needs an `hf:` model with a chat template; {source} has none")
    inner = load_tokenizer(source).inner
    if not getattr(inner, "chat_template", None):
        raise ValueError(f"`chat_template = true`, but the tokenizer of {source} has no chat template "
                         "(tokenizer_config.json `chat_template`)")
    def formatted(prompt) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return inner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return formatted


__all__ = ["BUILTIN_TINY", "CharTokenizer", "chat_formatter", "load_model", "load_tokenizer"]
