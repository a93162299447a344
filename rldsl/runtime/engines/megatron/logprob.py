"""``MegatronLogprob``: response log-probabilities on megatron-core.

Shares the model, packing and tensor-parallel cross entropy with
``MegatronTrainer`` (``megatron_model``), so a frozen reference and the
trainer compute the same quantity for the same weights.
"""

from __future__ import annotations

from typing import Mapping

import torch

from rldsl.runtime.engines.megatron import model as mm
from rldsl.runtime.engines.megatron.hf_weights import HFToMegatronAssembler, LlamaShape
from rldsl.runtime.engines.torch.packing import forward_rows, scatter_rows, take_rows, trim_padding
from rldsl.runtime.protocols import FIELD_RESPONSE_IDS, Batch


class MegatronLogprob:
    """``protocols.LogprobEngine`` on megatron-core: forward only, no DDP.

    A frozen reference keeps the weights it was built with; a policy logprob
    stage receives Hugging Face-named buckets through ``update_weights``
    (a fused tensor whose parts span two buckets is assembled across them).
    With ``tokens_per_forward`` the rows of a forward are chosen by token
    budget and their padding trimmed, as in the trainer.
    """

    def __init__(self, shape: LlamaShape, hf_weights: Mapping[str, torch.Tensor] | None = None, *, tp: int = 1,
                 pp: int = 1, dtype: str = "bf16", rows_per_forward: int | None = None, tokens_per_forward: int = 0,
                 seed: int = 0):
        mm.ensure_model_parallel(tp, pp, seed)
        if pp != 1:
            raise NotImplementedError("the megatron logprob engine runs without pipeline parallelism (pp = 1)")
        self.shape = shape
        self.rows_per_forward = rows_per_forward
        self.tokens_per_forward = tokens_per_forward
        self.device = mm.compute_device()
        self.model = mm.build_gpt_model(shape, mm.transformer_config(shape, dtype, tp, pp))
        if hf_weights is not None:
            mm.load_hf_weights(self.model, hf_weights, shape)
        self.model.eval().requires_grad_(False)
        self.version = 0
        self._pending_version: int | None = None
        self._assembler = HFToMegatronAssembler(shape, fused_norms=mm.uses_fused_norms())

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "MegatronLogprob":
        shape = LlamaShape.from_hf_config(mm.read_hf_config(path))
        return cls(shape, mm.read_hf_weights(path), **kwargs)

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        if self._pending_version is not None:
            raise RuntimeError(f"weight sync to version {self._pending_version} is in progress")
        groups = forward_rows(batch, self.rows_per_forward, self.tokens_per_forward)
        trim = trim_padding if self.tokens_per_forward else dict
        results = ((rows, self._chunk_logprobs(trim(take_rows(batch, rows)))) for rows in groups)
        return scatter_rows(results, *batch[FIELD_RESPONSE_IDS].shape)

    def _chunk_logprobs(self, chunk: Batch) -> torch.Tensor:
        packed = mm.pack_rows(chunk, self.device)
        return mm.response_logprobs_from_logits(mm.forward_logits(self.model, packed), packed).cpu()

    def update_weights(self, bucket: Mapping[str, torch.Tensor], version: int, last: bool) -> None:
        from megatron.core import parallel_state

        if self._pending_version not in (None, version):
            raise RuntimeError(f"bucket for version {version} arrived during the sync to {self._pending_version}")
        complete = dict(self._assembler.add(bucket.items()))
        mm.load_megatron_weights(self.model, complete, parallel_state.get_tensor_model_parallel_world_size(),
                                 parallel_state.get_tensor_model_parallel_rank())
        if last and self._assembler.pending():
            raise RuntimeError(f"the last bucket left fused weights incomplete: {self._assembler.pending()[:3]}")
        self._pending_version = None if last else version
        if last:
            self.version = version

    def sleep(self) -> None:
        """Weights to host memory (colocated placement); a no-op on CPU."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake(self) -> None:
        self.model.to(self.device)
