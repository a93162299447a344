"""``TorchLogprob``: policy or frozen reference log-probabilities under a torch model."""

from __future__ import annotations

import torch

from rldsl.runtime.engines.torch.common import WeightReceiver, response_logprobs, split_rows
from rldsl.runtime.protocols import Batch


class TorchLogprob(WeightReceiver):
    """Response log-probabilities under a model copy.

    A frozen reference never receives ``update_weights``; a policy logprob
    stage does, exactly like a generator.
    """

    def __init__(self, model, rows_per_forward: int | None = None):
        self.model = model
        self.rows_per_forward = rows_per_forward
        self.version = 0
        model.module.eval()
        model.module.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        self.require_consistent_weights()
        chunks = [response_logprobs(self.model, chunk).cpu() for chunk in split_rows(batch, self.rows_per_forward)]
        return torch.cat(chunks) if chunks else torch.zeros(0, 0)
