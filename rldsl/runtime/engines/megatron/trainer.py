"""``MegatronTrainer``: the split-step trainer on megatron-core (the logprob
engine is ``megatron_logprob.MegatronLogprob``).

The split step (seeds 000/001):

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
  UN-normalised GRPO loss sum (``grpo_loss``), so the grad buffers hold raw
  d(sum)/dθ, and adds the microbatch's local token and sequence counts.
- ``finish_train_step`` all-reduces the counts over the data-parallel group
  to get the global N (tokens or sequences, by the loss level), scales the
  gradients by 1/N, runs the one gradient reduction (``start_grad_sync`` +
  ``finish_grad_sync``), steps the optimizer (which clips), restores the
  hooks, advances the LR scheduler by the global batch and bumps the version.
- ``abort_train_step`` restores the hooks and zeroes the gradients; it is
  idempotent.

If a microbatch or finish raises, the hooks are restored before the
exception propagates and the step is marked failed: the caller must abort
it (later calls on it raise).

``TransformerConfig.calculate_per_token_loss`` is on, so DDP sums gradients
over data-parallel ranks instead of averaging them and the schedule neither
divides the loss by the microbatch count nor scales the MoE auxiliary loss
by it (Megatron's router multiplies it by the token count instead, so after
the 1/N at finish it has the weight Megatron's per-token mode gives it).
The auxiliary-loss METRICS are accumulated over every pipeline microbatch
of the step and divided by that count at finish.

Outside a step (``megatron_state``): ``save_checkpoint(directory)`` is a
collective in which every rank writes ``directory/megatron/rankNNNNN.pt``
(its model shard, optimizer state, including the distributed optimizer's
shard, LR scheduler, version and the tp/pp/dp layout) and waits for the
others; ``load_checkpoint`` reads each rank's own file back and requires the
same layout (no resharding). With ``offload = true``, ``sleep`` copies the
weights (DDP's param buffers or the parameters) and the optimizer state
(fp32 main params and moments) to host memory and frees their device
storage in place, dropping the gradient buffers; ``wake`` restores them
(gradients as zeros). Without offload both are no-ops. While asleep the
trainer refuses steps, weight export and checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from rldsl.runtime.engines.grpo_loss import GRPOLossConfig, grpo_loss, step_metrics
from rldsl.runtime.engines.megatron import model as mm
from rldsl.runtime.engines.megatron import state as ms
from rldsl.runtime.engines.megatron.hf_weights import LlamaShape
from rldsl.runtime.engines.torch.common import split_rows
from rldsl.runtime.protocols import (
    FIELD_ADVANTAGE,
    FIELD_BEHAVIOUR_LOGPROBS,
    FIELD_REF_LOGPROBS,
    FIELD_RESPONSE_IDS,
    FIELD_RESPONSE_MASK,
    Batch,
    StepResult,
)

log = logging.getLogger(__name__)
COUNTS = ("tokens", "sequences")
LOSS_STATS = ("loss_sum", "kl_sum", "clipped_tokens", "ratio_sum")
SYNC_HOOKS = ("grad_sync_func", "no_sync_func", "finalize_model_grads_func")


@dataclass
class _OpenStep:
    step: int
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTS + LOSS_STATS, 0.0))
    pipeline_microbatches: int = 0
    failed: bool = False


class MegatronTrainer:
    """``protocols.Trainer`` on megatron-core (GPTModel + DDP + Megatron optimizer)."""

    def __init__(
        self,
        shape: LlamaShape,
        hf_weights: Mapping[str, torch.Tensor] | None = None,
        *,
        tp: int = 1,
        pp: int = 1,
        dtype: str = "bf16",
        distributed_optimizer: bool = True,
        overlap_grad_reduce: bool = True,
        offload: bool = False,
        loss: GRPOLossConfig | dict | None = None,
        lr: float = 1e-5,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        rows_per_forward: int | None = None,
        global_batch: int | None = None,
        lr_warmup_samples: int = 0,
        seed: int = 0,
    ):
        mm.ensure_model_parallel(tp, pp, seed)
        self.shape = shape
        self.loss = loss if isinstance(loss, GRPOLossConfig) else GRPOLossConfig(**(loss or {}))
        self.rows_per_forward = rows_per_forward
        self.global_batch = global_batch
        self.offload = offload  # sleep/wake move the weights and optimizer state to host memory
        self._offload = ms.DeviceOffload()
        self.device = mm.compute_device()
        self.config = mm.transformer_config(shape, dtype, tp, pp)
        module = mm.build_gpt_model(shape, self.config)
        if hf_weights is not None:
            mm.load_hf_weights(module, hf_weights, shape)
        self.ddp_config = self._ddp_config(dtype, distributed_optimizer, overlap_grad_reduce)
        self.model = self._wrap_ddp(module)
        self.optimizer = self._build_optimizer(dtype, distributed_optimizer, lr, betas, weight_decay, max_grad_norm)
        self.scheduler = self._build_scheduler(lr, weight_decay, lr_warmup_samples)
        self._install_sync_hooks()
        self.version = 0
        self._open: _OpenStep | None = None
        self._saved_hooks: dict[str, Any] | None = None

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "MegatronTrainer":
        """From a local Hugging Face checkpoint directory (config.json + weights)."""
        shape = LlamaShape.from_hf_config(mm.read_hf_config(path))
        return cls(shape, mm.read_hf_weights(path), **kwargs)

    # -- construction ------------------------------------------------------------

    @staticmethod
    def _ddp_config(dtype, distributed_optimizer, overlap_grad_reduce):
        from megatron.core.distributed import DistributedDataParallelConfig

        return DistributedDataParallelConfig(
            grad_reduce_in_fp32=dtype != "fp32",
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=distributed_optimizer,
            average_in_collective=False,  # a sum: the trainer divides by the global count
        )

    def _wrap_ddp(self, module):
        from megatron.core.distributed import DistributedDataParallel

        model = DistributedDataParallel(config=self.config, ddp_config=self.ddp_config, module=module)
        model.broadcast_params()  # every data-parallel replica starts from rank 0's weights
        return model

    def _build_optimizer(self, dtype, distributed_optimizer, lr, betas, weight_decay, max_grad_norm):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=lr,
            weight_decay=weight_decay,
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            clip_grad=max_grad_norm or 0.0,
            bf16=dtype == "bf16",
            fp16=dtype == "fp16",
            params_dtype=mm.DTYPES[dtype],
            use_distributed_optimizer=distributed_optimizer,
        )
        return get_megatron_optimizer(config, [self.model])

    def _build_scheduler(self, lr, weight_decay, warmup_samples):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        horizon = 2**62  # constant LR after warmup: the decay horizon is never reached
        return OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup_samples else lr, max_lr=lr, min_lr=lr,
            lr_warmup_steps=warmup_samples, lr_decay_steps=horizon, lr_decay_style="constant",
            start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=horizon, wd_incr_style="constant",
        )

    def _install_sync_hooks(self) -> None:
        """The hooks a plain Megatron training loop installs; the split step
        nulls them while a step is open."""
        from megatron.core.distributed import finalize_model_grads

        self.config.no_sync_func = self.model.no_sync
        self.config.grad_sync_func = self.model.start_grad_sync if self.ddp_config.overlap_grad_reduce else None
        self.config.finalize_model_grads_func = finalize_model_grads

    # -- the split-step protocol -------------------------------------------------

    def begin_train_step(self, step: int) -> None:
        if self._open is not None:
            raise RuntimeError(f"begin_train_step({step}) while step {self._open.step} is open; finish or abort it")
        self._require_awake(f"begin_train_step({step})")
        self._zero_grads()
        self._save_and_null_sync_hooks()
        self._open = _OpenStep(step)

    def train_microbatch(self, step: int, batch: Batch) -> dict[str, float]:
        """Forward + backward of the un-normalised loss sum; returns local sums."""
        self._require_open(step, "train_microbatch")
        try:
            return self._train_microbatch_body(batch)
        except BaseException:
            self._fail_open_step("train_microbatch")
            raise

    def finish_train_step(self, step: int) -> StepResult:
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
        self._restore_sync_hooks()
        self._zero_grads()
        self._open = None

    def weight_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """Hugging Face-named CPU tensors (tensor-parallel shards gathered) in
        buckets of at most ``bucket_bytes``. A collective over the tensor- and
        pipeline-parallel groups: call it on every trainer rank; only the
        first rank of a model replica yields buckets."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self._require_awake("weight_buckets")
        bucket, used = {}, 0
        for name, tensor in mm.export_hf_weights(self.model.module, self.shape):
            size = tensor.numel() * tensor.element_size()
            if bucket and used + size > bucket_bytes:
                yield bucket
                bucket, used = {}, 0
            bucket[name] = tensor
            used += size
        if bucket:
            yield bucket

    # -- checkpoints and offload (megatron_state) -----------------------------------

    def save_checkpoint(self, directory) -> None:
        """A collective: every rank writes ``directory/megatron/rank{rank:05d}.pt``
        and, when it returns on any rank, every rank's file is written."""
        self._require_idle("save_checkpoint")
        ms.save_checkpoint(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                           version=self.version, distributed_optimizer=self.ddp_config.use_distributed_optimizer)

    def load_checkpoint(self, directory) -> int:
        """This rank's file back (same tp/pp/dp layout only); returns the version."""
        self._require_idle("load_checkpoint")
        self.version = ms.load_checkpoint(directory, model=self.model, optimizer=self.optimizer,
                                          scheduler=self.scheduler,
                                          distributed_optimizer=self.ddp_config.use_distributed_optimizer)
        return self.version

    def sleep(self) -> None:
        """With offload: weights and optimizer state to host memory, device
        storage freed, gradients dropped. Idempotent; a no-op without offload."""
        if self._open is not None:
            raise RuntimeError(f"sleep while step {self._open.step} is open; finish or abort it first")
        if self.offload and not self._offload.asleep:
            self.optimizer.zero_grad()  # drop .grad references into the grad buffers
            self._offload.sleep(*ms.offload_tensors(self.model, self.optimizer), self.device)

    def wake(self) -> None:
        """Undo ``sleep`` (gradients come back as zeros); idempotent."""
        self._offload.wake()

    @property
    def asleep(self) -> bool:
        return self._offload.asleep

    def _require_idle(self, call: str) -> None:
        if self._open is not None:
            raise RuntimeError(f"{call} while step {self._open.step} is open; finish or abort it first")
        self._require_awake(call)

    def _require_awake(self, call: str) -> None:
        if self._offload.asleep:
            raise RuntimeError(f"{call} while the trainer is asleep (offloaded); call wake first")

    # -- step bodies -------------------------------------------------------------

    def _train_microbatch_body(self, batch: Batch) -> dict[str, float]:
        chunks = list(split_rows(batch, self.rows_per_forward))
        if not chunks:
            return dict.fromkeys(COUNTS + LOSS_STATS, 0.0)  # no rows: nothing to add
        length = max(mm.packed_length(chunk) for chunk in chunks)
        rows = max(len(chunk[FIELD_RESPONSE_IDS]) for chunk in chunks)
        packed = [mm.pack_rows(chunk, self.device, length, rows) for chunk in chunks]
        sums = dict.fromkeys(COUNTS + LOSS_STATS, 0.0)
        for chunk in chunks:
            sums["tokens"] += float(chunk[FIELD_RESPONSE_MASK].sum())
            sums["sequences"] += float((chunk[FIELD_RESPONSE_MASK].sum(dim=1) > 0).sum())
        with self.model.no_sync():
            self._forward_backward()(
                forward_step_func=partial(self._forward_step, sums=sums),
                data_iterator=iter(packed),
                model=[self.model],
                num_microbatches=len(packed),
                seq_length=length,
                micro_batch_size=rows,
                forward_only=False,
            )
        for name, value in sums.items():
            self._open.sums[name] += value
        self._open.pipeline_microbatches += len(packed)
        return sums

    def _forward_step(self, data_iterator, model, sums: dict[str, float]):
        packed = next(data_iterator)
        return mm.forward_logits(model, packed), partial(self._loss_sum, packed, sums)

    def _loss_sum(self, packed: mm.PackedRows, sums: dict[str, float], logits: torch.Tensor):
        """The schedule's loss function: (un-normalised sum, local count, logged values)."""
        fields = packed.batch
        ref = fields.get(FIELD_REF_LOGPROBS)
        result = grpo_loss(mm.response_logprobs_from_logits(logits, packed), fields[FIELD_BEHAVIOUR_LOGPROBS],
                           fields[FIELD_ADVANTAGE], fields[FIELD_RESPONSE_MASK], self.loss, ref)
        sums["loss_sum"] += float(result.loss_sum.detach())
        for name in ("kl_sum", "clipped_tokens", "ratio_sum"):
            sums[name] += result.stats[name]
        count = torch.tensor(int(result.count), dtype=torch.int, device=logits.device)
        return result.loss_sum, count, {}

    def _finish_train_step_body(self) -> StepResult:
        totals = self._global_sums()
        count = totals["tokens" if self.loss.level == "token" else "sequences"]
        if count == 0:
            self.abort_train_step(self._open.step)
            return StepResult(self.version, {"skipped": 1.0})
        self.model.scale_gradients(1.0 / count)
        self._reduce_gradients_once()
        updated, grad_norm, _ = self.optimizer.step()
        self._restore_sync_hooks()
        metrics = self._step_metrics(totals, count, grad_norm)
        if updated:
            self.scheduler.step(increment=self.global_batch or int(totals["sequences"]))
            self.version += 1
        else:
            metrics["skipped"] = 1.0  # fp16 loss-scale overflow
        self._open = None
        return StepResult(self.version, metrics)

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

    def _save_and_null_sync_hooks(self) -> None:
        self._saved_hooks = {name: getattr(self.config, name) for name in SYNC_HOOKS}
        self.config.grad_sync_func = None
        self.config.finalize_model_grads_func = None
        self.config.no_sync_func = contextlib.nullcontext

    def _restore_sync_hooks(self) -> None:
        if self._saved_hooks is None:
            return
        for name, hook in self._saved_hooks.items():
            setattr(self.config, name, hook)
        self._saved_hooks = None

    def _fail_open_step(self, call: str) -> None:
        try:
            self._restore_sync_hooks()
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

    def _global_sums(self) -> dict[str, float]:
        """Counts summed over data-parallel ranks; loss statistics also over
        pipeline stages (only the last stage computes the loss)."""
        from megatron.core import parallel_state

        sums = self._open.sums
        counts = torch.tensor([sums[name] for name in COUNTS], dtype=torch.float64, device=self.device)
        stats = torch.tensor([sums[name] for name in LOSS_STATS], dtype=torch.float64, device=self.device)
        if dist.get_world_size() > 1:
            data_parallel = parallel_state.get_data_parallel_group()
            dist.all_reduce(counts, group=data_parallel)
            dist.all_reduce(stats, group=data_parallel)
            dist.all_reduce(stats, group=parallel_state.get_pipeline_model_parallel_group())
        return dict(zip(COUNTS + LOSS_STATS, counts.tolist() + stats.tolist()))

    def _step_metrics(self, totals: dict[str, float], count: float, grad_norm) -> dict[str, float]:
        metrics = step_metrics(totals, count, grad_norm, self.optimizer.param_groups[0]["lr"])
        metrics.update(self._moe_aux_loss_metrics())
        return metrics

    def _moe_aux_loss_metrics(self) -> dict[str, float]:
        """Each auxiliary loss per MoE layer and pipeline microbatch: Megatron's
        tracker sums it over the step's microbatches, one slot per layer
        (dense layers stay 0 and are left out of the mean)."""
        if not getattr(self.config, "num_moe_experts", None):
            return {}
        from megatron.core.transformer.moe import moe_utils

        moe_utils.reduce_aux_losses_tracker_across_ranks()
        microbatches = max(self._open.pipeline_microbatches, 1)
        metrics = {}
        for name, entry in moe_utils.get_moe_layer_wise_logging_tracker().items():
            per_layer = entry["values"].float()
            recorded = per_layer[per_layer != 0]
            metrics[f"moe/{name}"] = float(recorded.mean()) / microbatches if recorded.numel() else 0.0
        moe_utils.clear_aux_losses_tracker()
        return metrics

