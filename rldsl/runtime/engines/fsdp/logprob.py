"""``FsdpLogprob``: log-probabilities for an fsdp stage.

Scoring needs no gradients or optimizer state, so each logprob rank holds
the whole model in the engine's dtype (on its GPU when it has one) and
serves batches alone, like the torch engine's ``TorchLogprob``: sharding
would only add an all-gather per layer. A policy logprob stage receives
the trainer's weight buckets (full tensors, the same names) in place.
"""

from __future__ import annotations

from rldsl.runtime.engines.fsdp.sharding import DTYPES, training_device
from rldsl.runtime.engines.torch.logprob import TorchLogprob


class FsdpLogprob(TorchLogprob):
    def __init__(self, model, dtype: str = "fp32", rows_per_forward: int | None = None,
                 tokens_per_forward: int = 0):
        if dtype not in DTYPES:
            raise ValueError(f"fsdp: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        model.module.to(device=training_device(), dtype=DTYPES[dtype])
        super().__init__(model, rows_per_forward=rows_per_forward, tokens_per_forward=tokens_per_forward)
