"""``CausalLM``: what every engine holds, whatever the model source.

The builtin model (``rldsl.models.tiny``) and a local Hugging Face model
(``hf:<path>``, ``rldsl.models.hf``) look the same:
``forward(input_ids, attention_mask, position_ids, cache)`` returns
``(logits, cache)`` where ``attention_mask`` covers the cached keys plus the
new tokens.
"""

from __future__ import annotations

BUILTIN_TINY = "builtin:tiny-lm"
# the same model with a vocabulary that spells tool calls, warm-started to call the builtin calculator
BUILTIN_AGENT = "builtin:tiny-agent"


class CausalLM:
    """What engines hold: a torch module, its tokenizer and a uniform forward."""

    def __init__(self, module, tokenizer, source: str, config: dict):  # module: a torch.nn.Module
        self.module = module
        self.tokenizer = tokenizer
        self.source = source
        self.config = config
        self.warm_start_report: dict | None = None  # set by rldsl.runtime.engines.torch.warmstart
        self.lora = None  # the LoraPlan of its adapters, once rldsl.models.lora added them

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def device(self):
        return next(self.module.parameters()).device

    def forward(self, input_ids, attention_mask, position_ids, cache=None, use_cache=True):
        """(logits [B, T, V], cache); the cache is None when ``use_cache`` is false."""
        logits, new_cache = self.module(input_ids, attention_mask, position_ids, cache)
        return logits, new_cache if use_cache else None

    def to(self, device) -> "CausalLM":
        self.module.to(device)
        return self
