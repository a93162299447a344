"""``MegatronTrainer``: the split-step trainer on megatron-core (the logprob
engine is ``megatron_logprob.MegatronLogprob``).

The split step (seeds 000/001); a step is one rollout batch, taken in one or
more optimizer steps:

- ``begin_train_step`` zeroes the DDP grad buffers and the optimizer, then
  saves and nulls the model config's ``grad_sync_func`` and
  ``finalize_model_grads_func`` and sets ``no_sync_func`` to a null context.
  Megatron's schedules call these hooks themselves: the no-pipelining
  schedule leaves its ``no_sync_func`` context before its last microbatch,
  which marks the grad buckets as on their last microbatch even inside our
  ``model.no_sync()``, so that backward counts gradients as ready (and the
  next step asserts on the stale counts); ``finalize_model_grads_func``
  would all-reduce after every call. Nulled, the schedule leaves
  synchronisation to the trainer.
- ``train_microbatch`` runs the schedule inside ``model.no_sync()`` on the
  UN-normalised policy loss sum (``policy_loss``), so the grad buffers hold
  raw d(sum)/dθ, and adds the microbatch's local token and sequence counts.
- ``optimizer_step`` (a mini-batch boundary) all-reduces the counts over the
  data-parallel group to get the global N (tokens or sequences, by the
  loss's aggregation), scales the gradients by 1/N, runs the one gradient
  reduction (``start_grad_sync`` + ``finish_grad_sync``), steps the
  optimizer (which clips) and the LR scheduler by one, and zeroes the grad
  buffers; the hooks stay nulled and the version is unchanged.
- ``finish_train_step`` does the same for the last mini-batch, restores the
  hooks and bumps the version by one.
- ``abort_train_step`` restores the hooks and zeroes the gradients; it is
  idempotent.

With ``behaviour_cap`` or a ``correction`` and several optimizer steps, the
optimizer steps wait for finish and later microbatches get their proximal
logprobs from a forward-only pass first (``proximal.py``).

If a microbatch, an optimizer step or finish raises, the hooks are restored
before the exception propagates and the step is marked failed: the caller
must abort it (later calls on it raise).

``TransformerConfig.calculate_per_token_loss`` is on, so DDP sums gradients
over data-parallel ranks instead of averaging them and the schedule neither
divides the loss by the microbatch count nor scales the MoE auxiliary loss
by it (Megatron's router multiplies it by the token count instead, so after
the 1/N at finish it has the weight Megatron's per-token mode gives it).
The auxiliary-loss METRICS are accumulated over every pipeline microbatch
of an optimizer step and divided by that count when it is taken.

Outside a step (``state.py``): checkpoints are a collective, one file per
rank, same tp/pp/dp layout to load; with ``offload = true`` ``sleep`` and
``wake`` move the weights and optimizer state to host memory and back.
While asleep the trainer refuses steps, weight export and checkpoints.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Iterator, Mapping

import torch

from rldsl.runtime.engines.megatron import components as mc
from rldsl.runtime.engines.megatron import model as mm
from rldsl.runtime.engines.megatron import rows as mr
from rldsl.runtime.engines.megatron import state as ms
from rldsl.runtime.engines.megatron.experts import ExpertLockstep
from rldsl.runtime.engines.megatron.hf_weights import LlamaShape
from rldsl.runtime.engines.megatron.open_step import LOSS_STATS, OpenStep, counted, global_sums, no_sums
from rldsl.runtime.engines.megatron.proximal import PROXIMAL, ProximalPass
from rldsl.runtime.engines.policy_loss import (
    EXTREME_STATS,
    PolicyLossConfig,
    first_weights_mismatch,
    merge_stats,
    policy_loss,
    rollout_metrics,
    step_metrics,
)
from rldsl.runtime.engines.schedule import LRSchedule
from rldsl.runtime.engines.torch.packing import forward_rows, take_rows, trim_padding
from rldsl.runtime.protocols import (
    FIELD_ADVANTAGE,
    FIELD_BEHAVIOUR_LOGPROBS,
    FIELD_REF_LOGPROBS,
    FIELD_RESPONSE_IDS,
    Batch,
    StepResult,
    trained_tokens,
)

log = logging.getLogger(__name__)
SKIPPED = {"skipped": 1.0}


class MegatronTrainer(ProximalPass, ms.CheckpointsAndOffload):
    """``protocols.Trainer`` on megatron-core (GPTModel + DDP + Megatron optimizer)."""

    # No forward swaps the parameters and the export gathers on groups of its own
    # (model.export_group): an export may run beside the next step's microbatches.
    exports_beside_steps = True

    def __init__(
        self,
        shape: LlamaShape,
        hf_weights: Mapping[str, torch.Tensor] | None = None,
        *,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        dtype: str = "bf16",
        distributed_optimizer: bool = True,
        overlap_grad_reduce: bool = True,
        offload: bool = False,
        loss: PolicyLossConfig | dict | None = None,
        lr: float = 1e-5,
        betas: tuple[float, float] = (0.9, 0.999),  # megatron-core's OptimizerConfig defaults
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        rows_per_forward: int | None = None,
        tokens_per_forward: int = 0,
        lr_schedule: LRSchedule | None = None,
        seed: int = 0,
        temperature: float = 1.0,
    ):
        self.loss = loss if isinstance(loss, PolicyLossConfig) else PolicyLossConfig(**(loss or {}))
        mm.ensure_model_parallel(tp, pp, seed, ep, etp)
        self.temperature = temperature  # the generators' sampling temperature: logprobs are taken at it
        self.shape = shape
        self.rows_per_forward = rows_per_forward
        self.tokens_per_forward = tokens_per_forward  # 0: off; else the token budget of a forward
        self.pipeline_parallel = pp
        schedule = lr_schedule or LRSchedule()
        schedule.check_base_lr(lr)
        self.offload = offload  # sleep/wake move the weights and optimizer state to host memory
        self._offload = ms.DeviceOffload()
        self.device = mm.compute_device()
        self.config = mm.transformer_config(shape, dtype, tp, pp, recompute_layers=True, ep=ep, etp=etp)
        module = mm.build_gpt_model(shape, self.config)
        if hf_weights is not None:
            mm.load_hf_weights(module, hf_weights, shape)
        self.ddp_config = mc.ddp_config(dtype, distributed_optimizer, overlap_grad_reduce)
        self.model = mc.wrap_ddp(module, self.config, self.ddp_config)
        self.optimizer = mc.build_optimizer(self.model, dtype, distributed_optimizer, lr,
                                               mc.schedule_min_lr(schedule, lr), betas, weight_decay,
                                               max_grad_norm, eps)
        self.scheduler = mc.build_scheduler(self.optimizer, lr, weight_decay, schedule)
        self.hooks = mc.SyncHooks(self.config, self.model, self.ddp_config)
        self.lockstep = ExpertLockstep(ep)
        self.version = 0
        self._open: OpenStep | None = None

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "MegatronTrainer":
        """From a local Hugging Face checkpoint directory (config.json + weights)."""
        shape = LlamaShape.from_hf_config(mm.read_hf_config(path))
        return cls(shape, mm.open_hf_weights(path), **kwargs)

    # -- the split-step protocol -------------------------------------------------

    def begin_train_step(self, step: int) -> None:
        if self._open is not None:
            raise RuntimeError(f"begin_train_step({step}) while step {self._open.step} is open; finish or abort it")
        self._require_awake(f"begin_train_step({step})")
        self._zero_grads()
        self.hooks.null()
        self._open = OpenStep(step)

    def train_microbatch(self, step: int, batch: Batch) -> dict[str, float]:
        """Forward + backward of the un-normalised loss sum; returns local sums
        (after a held optimizer step only the counts: training waits for finish)."""
        self._require_open(step, "train_microbatch")
        try:
            chunks = self._forward_chunks(batch)
            if self._open.held is not None:  # after a held optimizer step: proximal pass now, training at finish
                self._keep_with_proximal(chunks)
                return counted(chunks)
            return self._train_chunks(chunks)
        except BaseException:
            self._fail_open_step("train_microbatch")
            raise

    def optimizer_step(self, step: int) -> dict[str, float]:
        """One optimizer step on the mini-batch trained since the last one; the
        step stays open and the version is unchanged. A collective."""
        self._require_open(step, "optimizer_step")
        try:
            if self.loss.needs_proximal:
                return self._hold_optimizer_step()
            metrics = self._take_optimizer_step()
            self._zero_grads()
            return metrics or dict(SKIPPED)
        except BaseException:
            self._fail_open_step("optimizer_step")
            raise

    def finish_train_step(self, step: int) -> StepResult:
        """The rollout batch's last optimizer step; bumps the version once."""
        self._require_open(step, "finish_train_step")
        try:
            return self._finish_train_step_body()
        except BaseException:
            self._fail_open_step("finish_train_step")
            raise

    def abort_train_step(self, step: int) -> None:
        """Drop the open step (whichever it is) and its gradients; safe to repeat."""
        if self._open is not None and self._open.step != step:
            log.warning("abort_train_step(%s) dropped open step %s", step, self._open.step)
        self.hooks.restore()
        self._zero_grads()
        self._open = None

    streams_from_device = True  # weight_buckets(on_host=False): gathered on the GPU, for a stream

    def weight_buckets(self, bucket_bytes: int, on_host: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """Hugging Face-named tensors (tensor-parallel shards gathered) in
        buckets of at most ``bucket_bytes``: CPU copies, or without
        ``on_host`` on the device, for a rank-to-rank push. A collective over
        the tensor- and pipeline-parallel groups: call it on every trainer
        rank; only the first rank of a model replica yields buckets."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self._require_awake("weight_buckets")
        bucket, used = {}, 0
        for name, tensor in mm.export_hf_weights(self.model.module, self.shape, on_host):
            size = tensor.numel() * tensor.element_size()
            if bucket and used + size > bucket_bytes:
                yield bucket
                bucket, used = {}, 0
            bucket[name] = tensor
            used += size
        if bucket:
            yield bucket

    # -- step bodies -------------------------------------------------------------

    def _forward_chunks(self, batch: Batch) -> list[Batch]:
        """The rows of each pipeline microbatch: ``rows_per_forward`` rows, or
        as many as the token budget holds, padding trimmed."""
        groups = forward_rows(batch, self.rows_per_forward, self.tokens_per_forward)
        chunks = [take_rows(batch, rows) for rows in groups]
        return [trim_padding(chunk) for chunk in chunks] if self.tokens_per_forward else chunks

    def _pack(self, chunks: list[Batch]) -> tuple[list[mr.PackedRows], int, int]:
        """Packed chunks, the sequence length and rows the schedule is told.
        Pipeline stages exchange activations of one shape, so with pp > 1
        every chunk is padded to the largest (``mr.pipeline_length``); without,
        each keeps its own."""
        length = max(mr.packed_length(chunk) for chunk in chunks)
        rows = max(len(chunk[FIELD_RESPONSE_IDS]) for chunk in chunks)
        if self.pipeline_parallel == 1:
            return [mr.pack_rows(chunk, self.device, temperature=self.temperature) for chunk in chunks], length, rows
        length = mr.pipeline_length(length, self.config)
        return [mr.pack_rows(chunk, self.device, length, rows, self.temperature) for chunk in chunks], length, rows

    def _train_chunks(self, chunks: list[Batch]) -> dict[str, float]:
        """One schedule over a call's pipeline microbatches; adds their sums to the open step's."""
        if not chunks:
            return no_sums()  # no rows: nothing to add
        packed, length, rows = self._pack(chunks)
        sums = counted(chunks)
        # under expert parallelism one forward a round (ExpertLockstep), else the call's forwards in one schedule
        for some in ([[chunk] for chunk in packed] if self.lockstep.needed else [packed]):
            if self.lockstep.needed:
                self.lockstep.round(has_rows=True)
            self._run_schedule(some, length, rows, partial(self._forward_step, sums=sums))
        self._open.add(sums, len(packed))
        return sums

    def _run_schedule(self, packed: list, length: int, rows: int, forward_step) -> None:
        with self.model.no_sync():
            self._forward_backward()(forward_step_func=forward_step, data_iterator=iter(packed), model=[self.model],
                                     num_microbatches=len(packed), seq_length=length, micro_batch_size=rows,
                                     forward_only=False)

    def _join_expert_rounds(self) -> None:
        """Empty forwards and backwards until no rank of the expert-parallel group has rows (ExpertLockstep)."""
        if not self.lockstep.needed:
            return  # every optimizer step comes here: nothing to build without expert parallelism
        empty = [mr.empty_round(self.device)]
        self.lockstep.join_rounds(lambda: self._run_schedule(empty, 1, 1, mr.empty_forward_step))

    def _forward_step(self, data_iterator, model, sums: dict[str, float]):
        packed = next(data_iterator)
        return mr.forward_logits(model, packed), partial(self._loss_sum, packed, sums)

    def _loss_sum(self, packed: mr.PackedRows, sums: dict[str, float], logits: torch.Tensor):
        """The schedule's loss function: (un-normalised sum, local count, logged values)."""
        fields = packed.batch
        ref = fields.get(FIELD_REF_LOGPROBS)
        logprobs, behaviour, mask = (mr.response_logprobs_from_logits(logits, packed),
                                     fields[FIELD_BEHAVIOUR_LOGPROBS], trained_tokens(fields))
        proximal = fields.get(PROXIMAL)
        result = policy_loss(logprobs, behaviour, fields[FIELD_ADVANTAGE], mask, self.loss, ref, proximal)
        result.stats.update(first_weights_mismatch(fields, logprobs, proximal, behaviour, mask, self.version,
                                                   stepped=bool(self._open.taken)))
        merge_stats(sums, {"loss_sum": float(result.loss_sum.detach()),
                           **{name: result.stats[name] for name in (*LOSS_STATS[1:], *EXTREME_STATS)
                              if name in result.stats}})
        count = torch.tensor(int(result.count), dtype=torch.int, device=logits.device)
        return result.loss_sum, count, {}

    def _finish_train_step_body(self) -> StepResult:
        attempt = self._take_optimizer_step() if self._open.held is None else self._take_held_optimizer_steps()
        self.hooks.restore()
        taken, self._open = self._open.taken, None
        if not taken:
            if attempt is None:
                self._zero_grads()  # nothing to learn from: left as an abort leaves it
            return StepResult(self.version, attempt or dict(SKIPPED))
        self.version += 1
        return StepResult(self.version, rollout_metrics(taken))

    def _take_optimizer_step(self) -> dict[str, float] | None:
        """Scale, reduce and step on the sums since the last optimizer step:
        its metrics (``skipped`` on an fp16 overflow), None without tokens."""
        self._join_expert_rounds()
        sums, microbatches = self._open.restart_sums()
        totals = global_sums(sums, self.device)
        count = totals[self.loss.count_name]
        if count == 0:
            return None
        self.model.scale_gradients(1.0 / count)
        self._reduce_gradients_once()
        updated, grad_norm, _ = self.optimizer.step()
        metrics = self._step_metrics(totals, count, grad_norm, microbatches)
        if not updated:
            return {**metrics, "skipped": 1.0}  # fp16 loss-scale overflow
        self.scheduler.step(increment=1)
        self._open.taken.append(metrics)
        return metrics

    def _reduce_gradients_once(self) -> None:
        """One data-parallel reduction. With overlap, ``start_grad_sync``
        dispatches it and ``finish_grad_sync`` waits; without, finish runs it
        synchronously and calling start first would reduce twice.
        ``finalize_model_grads`` calls ``finish_grad_sync`` and then syncs
        what pipeline parallelism shares (tied embeddings across stages)."""
        from megatron.core.distributed import finalize_model_grads

        if self.ddp_config.overlap_grad_reduce:
            self.model.start_grad_sync()
        finalize_model_grads([self.model])

    # -- hooks and bookkeeping -------------------------------------------------------

    def _fail_open_step(self, call: str) -> None:
        try:
            self.hooks.restore()
        except Exception:  # never hide the original error
            log.exception("restoring Megatron's sync hooks after %s failed", call)
        if self._open is not None:
            self._open.failed = True

    def _require_open(self, step: int, call: str) -> None:
        if self._open is None:
            raise RuntimeError(f"{call}({step}) without an open step; call begin_train_step first")
        if self._open.step != step:
            raise RuntimeError(f"{call}({step}) but the open step is {self._open.step}")
        if self._open.failed:
            raise RuntimeError(f"{call}({step}): the step failed earlier; abort it")

    def _zero_grads(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _forward_backward(self):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()

    def _step_metrics(self, totals: dict[str, float], count: float, grad_norm, microbatches: int) -> dict[str, float]:
        metrics = step_metrics(totals, count, grad_norm, self.optimizer.param_groups[0]["lr"])
        metrics.update(mc.moe_aux_loss_metrics(self.config, microbatches))
        return metrics
