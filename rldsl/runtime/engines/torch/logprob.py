"""``TorchLogprob``: policy or frozen reference log-probabilities under a torch model."""

from __future__ import annotations

import torch

from rldsl.runtime.engines.torch.common import (
    WeightReceiver,
    packed_response_logprobs,
    response_logprobs,
    split_rows,
)
from rldsl.runtime.engines.torch.offload import on_device_for_call
from rldsl.runtime.engines.torch.packing import forward_rows, scatter_rows, take_rows, trim_padding
from rldsl.runtime.protocols import FIELD_RESPONSE_IDS, Batch


class TorchLogprob(WeightReceiver):
    """Response log-probabilities under a model copy.

    A frozen reference never receives ``update_weights``; a policy logprob
    stage does, exactly like a generator. With ``tokens_per_forward`` the
    rows of a forward are chosen by token budget, as in the trainer. With
    ``offload`` the weights stay in host memory between calls (offload.py);
    pushes are copied into them there. ``temperature``: the generators'
    sampling temperature, which the log-probabilities are taken at.
    """

    def __init__(self, model, rows_per_forward: int | None = None, tokens_per_forward: int = 0,
                 offload: bool = False, temperature: float = 1.0):
        self.model = model
        self.temperature = temperature
        self.rows_per_forward = rows_per_forward
        self.tokens_per_forward = tokens_per_forward
        self.offload = offload
        self.version = 0
        model.module.eval()
        model.module.requires_grad_(False)
        if offload:
            self.sleep()

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        self.require_consistent_weights()
        with on_device_for_call(self):
            if self.tokens_per_forward:
                return self._budgeted_logprobs(batch)
            chunks = [response_logprobs(self.model, chunk, self.temperature).cpu()
                      for chunk in split_rows(batch, self.rows_per_forward)]
            return torch.cat(chunks) if chunks else torch.zeros(0, 0)

    def weight_snapshot(self) -> list[dict[str, torch.Tensor]]:
        """A host copy of the weights as one bucket ``update_weights`` takes
        back: a policy logprob stage keeps the version it started with."""
        weights = self.model.module.state_dict()
        return [{name: tensor.detach().to("cpu", copy=True) for name, tensor in weights.items()}]

    def _budgeted_logprobs(self, batch: Batch) -> torch.Tensor:
        groups = forward_rows(batch, None, self.tokens_per_forward)
        results = ((rows, packed_response_logprobs(self.model, trim_padding(take_rows(batch, rows)), self.temperature))
                   for rows in groups)
        return scatter_rows(results, *batch[FIELD_RESPONSE_IDS].shape)
