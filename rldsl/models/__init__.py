"""Models the torch engines run: the builtin tiny-lm and local HF models.

Importing this package does not import torch; ``load_model`` does. The
builtin model's supervised warm start is the torch engines' business
(``rldsl.runtime.engines.torch.warmstart``): a model source knows nothing of
engines.
"""

import functools

from rldsl.models.base import BUILTIN_AGENT, BUILTIN_TINY
from rldsl.models.tokenizer import AGENT_CHARACTERS, CharTokenizer

TINY_GPT2 = "builtin:tiny-gpt2"  # rldsl.models.tiny_gpt2: the builtin model with one 64-wide head, as GPT-2
BUILTIN_MODELS = (BUILTIN_TINY, TINY_GPT2, BUILTIN_AGENT)
AGENT_SHAPE = {"max_positions": 128}  # TinyLMConfig overrides: room for a call, its result and an answer


def load_model(source: str, device="cpu", *, seed: int = 0, **options):
    """Load ``builtin:tiny-lm`` (freshly initialised from ``seed``; with
    ``builtin:tiny-gpt2``'s one head for it, ``builtin:tiny-agent``'s
    vocabulary for it) or ``hf:<local path>``
    (pretrained; ``seed`` ignored) onto ``device``. ``options`` override
    ``TinyLMConfig`` fields, or reach ``rldsl.models.hf.load_hf_model``
    (e.g. ``dtype``). The engines load ``builtin:tiny-gpt2`` in its GPT-2
    form, from the directory the runtime writes."""
    if source in BUILTIN_MODELS:
        from rldsl.models.tiny import build_tiny_lm

        return build_tiny_lm(seed, builtin_tokenizer(source), source if source == BUILTIN_AGENT else BUILTIN_TINY,
                             **{**builtin_shape(source), **options}).to(device)
    if source.startswith("hf:"):
        from rldsl.models.hf import load_hf_model

        return load_hf_model(source[len("hf:"):], device, **options)
    raise ValueError(f"unknown model source {source!r}: expected one of {', '.join(BUILTIN_MODELS)} or "
                     "'hf:<local path>'")


def load_tokenizer(source: str):
    """The tokenizer of a model source, without loading its weights."""
    if source.startswith("hf:"):
        from transformers import AutoTokenizer

        from rldsl.models.hf import HFTokenizer

        return HFTokenizer(AutoTokenizer.from_pretrained(source[len("hf:"):], local_files_only=True))
    return builtin_tokenizer(source)


def builtin_shape(source: str) -> dict:
    """A builtin model's ``TinyLMConfig`` overrides of tiny-lm's."""
    if source == TINY_GPT2:
        from rldsl.models.tiny_gpt2 import TINY_GPT2_SHAPE

        return TINY_GPT2_SHAPE
    return AGENT_SHAPE if source == BUILTIN_AGENT else {}


def builtin_tokenizer(source: str) -> CharTokenizer:
    """A builtin model's character tokenizer: tiny-agent's spells tool calls."""
    return CharTokenizer(AGENT_CHARACTERS) if source == BUILTIN_AGENT else CharTokenizer()


@functools.lru_cache(maxsize=8)
def chat_formatter(source: str):
    """``prompt -> text`` through the model's chat template, the assistant's
    turn opened: a string prompt as one user turn, a list of chat messages
    (``{"role", "content"}``) as it is. Only `hf:` models have one; a
    tokenizer without a template is refused rather than silently skipped.
    Cached: the preflight and every dataset load of a run ask for the same
    model's, and a tokenizer takes a while to load."""
    from rldsl.launch_rules import chat_template_refusal

    refused = chat_template_refusal(source, True)  # `check` refuses it too (RLP112)
    if refused:
        raise ValueError(refused)
    inner = load_tokenizer(source).inner
    if not getattr(inner, "chat_template", None):
        raise ValueError(f"`chat_template = true`, but the tokenizer of {source} has no chat template "
                         "(tokenizer_config.json `chat_template`)")
    def formatted(prompt) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return inner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return formatted


__all__ = ["BUILTIN_AGENT", "BUILTIN_MODELS", "BUILTIN_TINY", "TINY_GPT2", "CharTokenizer", "builtin_shape",
           "builtin_tokenizer", "chat_formatter", "load_model", "load_tokenizer"]
