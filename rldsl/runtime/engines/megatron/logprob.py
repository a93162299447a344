"""``MegatronLogprob``: response log-probabilities on megatron-core.

Shares the model, packing and tensor-parallel cross entropy with
``MegatronTrainer`` (``megatron_model``), so a frozen reference and the
trainer compute the same quantity for the same weights.

With pp > 1 the forwards run as Megatron's forward-only pipeline schedule:
every rank of the replica takes part, only the last pipeline stage has
logits, so only it returns log-probabilities (the others return None).
"""

from __future__ import annotations

from functools import partial
from typing import Mapping

import torch

from rldsl.runtime.engines.megatron import model as mm
from rldsl.runtime.engines.megatron import rows as mr
from rldsl.runtime.engines.megatron.experts import ExpertLockstep
from rldsl.runtime.engines.megatron.hf_weights import HFToMegatronAssembler, LlamaShape
from rldsl.runtime.engines.torch.offload import on_device_for_call
from rldsl.runtime.engines.torch.packing import forward_rows, scatter_rows, take_rows, trim_padding
from rldsl.runtime.protocols import FIELD_RESPONSE_IDS, Batch


class MegatronLogprob:
    """``protocols.LogprobEngine`` on megatron-core: forward only, no DDP.

    A frozen reference keeps the weights it was built with; a policy logprob
    stage receives Hugging Face-named buckets through ``update_weights``
    (a fused tensor whose parts span two buckets is assembled across them).
    With ``tokens_per_forward`` the rows of a forward are chosen by token
    budget and their padding trimmed, as in the trainer. With ``offload``
    the weights stay in host memory between calls.
    """

    def __init__(self, shape: LlamaShape, hf_weights: Mapping[str, torch.Tensor] | None = None, *, tp: int = 1,
                 pp: int = 1, ep: int = 1, etp: int | None = None, dtype: str = "bf16",
                 rows_per_forward: int | None = None,
                 tokens_per_forward: int = 0, seed: int = 0, offload: bool = False, temperature: float = 1.0):
        mm.ensure_model_parallel(tp, pp, seed, ep, etp)
        self.temperature = temperature  # the generators' sampling temperature: logprobs are taken at it
        self.pipeline_parallel = pp
        self.shape = shape
        self.rows_per_forward = rows_per_forward
        self.tokens_per_forward = tokens_per_forward
        self.device = mm.compute_device()
        self.model = mm.build_gpt_model(shape, mm.transformer_config(shape, dtype, tp, pp, ep=ep, etp=etp))
        if hf_weights is not None:
            mm.load_hf_weights(self.model, hf_weights, shape)
        self.model.eval().requires_grad_(False)
        self.version = 0
        self._pending_version: int | None = None
        self._assembler = HFToMegatronAssembler(shape, fused_norms=mm.uses_fused_norms())
        self.lockstep = ExpertLockstep(ep)
        self.offload = offload  # weights in host memory between calls (torch/offload.py)
        if offload:
            self.sleep()

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "MegatronLogprob":
        shape = LlamaShape.from_hf_config(mm.read_hf_config(path))
        return cls(shape, mm.open_hf_weights(path), **kwargs)

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor | None:
        """[rows, response length] log-probabilities; None on a pipeline stage
        other than the last (it only relays activations)."""
        if self._pending_version is not None:
            raise RuntimeError(f"weight sync to version {self._pending_version} is in progress")
        with on_device_for_call(self):
            return self._logprobs(batch)

    def _logprobs(self, batch: Batch) -> torch.Tensor | None:
        groups = forward_rows(batch, self.rows_per_forward, self.tokens_per_forward)
        trim = trim_padding if self.tokens_per_forward else dict
        chunks = [trim(take_rows(batch, rows)) for rows in groups]
        if self.pipeline_parallel == 1:
            results = zip(groups, map(self._chunk_logprobs, chunks))
            if self.lockstep.needed:  # every chunk's forward a round of its own, then the others' rounds joined
                results = list(results)
                empty = mr.empty_round(self.device)
                self.lockstep.join_rounds(lambda: mr.forward_logits(self.model, empty))
        else:
            results = self._pipelined_logprobs(groups, chunks)
            if results is None:
                return None
        return scatter_rows(results, *batch[FIELD_RESPONSE_IDS].shape)

    def _chunk_logprobs(self, chunk: Batch) -> torch.Tensor:
        if self.lockstep.needed:
            self.lockstep.round(has_rows=True)
        packed = mr.pack_rows(chunk, self.device, temperature=self.temperature)
        return mr.response_logprobs_from_logits(mr.forward_logits(self.model, packed), packed).cpu()

    def _pipelined_logprobs(self, groups: list, chunks: list[Batch]) -> list | None:
        """One forward-only pipeline schedule over every chunk: (rows, logprobs)
        pairs on the last stage, None elsewhere. Stages exchange activations
        of one shape, so every chunk is padded to the largest. Under expert
        parallelism a schedule per chunk, each a round, then the group's
        other rounds joined (every stage of a replica decides alike)."""
        from megatron.core import parallel_state

        outputs = []
        for some in ([[chunk] for chunk in chunks] if self.lockstep.needed else [chunks] if chunks else []):
            if self.lockstep.needed:
                self.lockstep.round(has_rows=True)
            length = mr.pipeline_length(max(mr.packed_length(chunk) for chunk in some), self.model.config)
            rows = max(len(chunk[FIELD_RESPONSE_IDS]) for chunk in some)
            packed = [mr.pack_rows(chunk, self.device, length, rows, self.temperature) for chunk in some]
            outputs += mr.forward_only(self.model, packed, length, rows, logprob_forward_step)
        empty = [mr.empty_round(self.device)]
        self.lockstep.join_rounds(lambda: mr.forward_only(self.model, empty, 1, 1, mr.empty_forward_step))
        if not parallel_state.is_pipeline_last_stage():
            return None
        return list(zip(groups, (out["logprobs"] for out in outputs)))

    def update_weights(self, bucket: Mapping[str, torch.Tensor], version: int, last: bool) -> None:
        if self._pending_version not in (None, version):
            raise RuntimeError(f"bucket for version {version} arrived during the sync to {self._pending_version}")
        complete = dict(self._assembler.add(bucket.items()))
        mm.load_megatron_weights(self.model, complete, self.shape)
        if last and self._assembler.pending():
            raise RuntimeError(f"the last bucket left fused weights incomplete: {self._assembler.pending()[:3]}")
        self._pending_version = None if last else version
        if last:
            self.version = version

    def sleep(self) -> None:
        """Weights to host memory (between calls with ``offload``); a no-op on CPU."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake(self) -> None:
        self.model.to(self.device)


def logprob_forward_step(data_iterator, model):
    """The schedule's step: logits (hidden states before the last stage) and
    the function the last stage applies to them."""
    packed = next(data_iterator)
    return mr.forward_logits(model, packed), partial(_collect_logprobs, packed)


def _collect_logprobs(packed: mr.PackedRows, logits: torch.Tensor):
    """The schedule's "loss": nothing to reduce; the logprobs ride in the
    reported values, which a forward-only schedule returns per microbatch."""
    logprobs = mr.response_logprobs_from_logits(logits, packed).cpu()
    zero = torch.zeros((), device=logits.device)
    return zero, torch.tensor(0, dtype=torch.int, device=logits.device), {"logprobs": logprobs}
