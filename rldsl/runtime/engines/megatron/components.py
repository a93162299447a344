"""The Megatron pieces of ``MegatronTrainer``: the DDP wrapper, optimizer and
LR scheduler configured for the split step, the sync hooks a step swaps out,
and the MoE auxiliary-loss metrics."""

from __future__ import annotations

import contextlib

from rldsl.runtime.engines.megatron import model as mm
from rldsl.runtime.engines.schedule import LRSchedule

NEVER = 2**62  # a decay horizon no run reaches: the LR stays constant after warmup


def ddp_config(dtype: str, distributed_optimizer: bool, overlap_grad_reduce: bool):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype != "fp32",
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=distributed_optimizer,
        average_in_collective=False,  # a sum: the trainer divides by the global count
    )


def wrap_ddp(module, config, ddp):
    from megatron.core.distributed import DistributedDataParallel

    model = DistributedDataParallel(config=config, ddp_config=ddp, module=module)
    model.broadcast_params()  # every data-parallel replica starts from rank 0's weights
    return model


def build_optimizer(model, dtype: str, distributed_optimizer: bool, lr: float, min_lr: float,
                    betas: tuple[float, float], weight_decay: float, max_grad_norm: float | None,
                    eps: float = 1e-8):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,  # each param group's floor, which the scheduler reads
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=max_grad_norm or 0.0,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        params_dtype=mm.DTYPES[dtype],
        use_distributed_optimizer=distributed_optimizer,
    )
    return get_megatron_optimizer(config, [model])


def schedule_min_lr(schedule: LRSchedule, lr: float) -> float:
    """The floor Megatron is given: a constant schedule never reaches it."""
    return schedule.min_lr if schedule.decays else lr


def build_scheduler(optimizer, lr: float, weight_decay: float, schedule: LRSchedule):
    """Megatron's scheduler with the schedule's style, stepped once per
    optimizer step: its formulas are ``LRSchedule.lr_at``'s."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=schedule.warmup_start_lr, max_lr=lr, min_lr=schedule_min_lr(schedule, lr),
        # megatron wants decay past warmup; a run shorter than its warmup never reaches the decay anyway
        lr_warmup_steps=schedule.warmup,
        lr_decay_steps=max(schedule.total, schedule.warmup + 1) if schedule.decays else NEVER,
        lr_decay_style=schedule.kind, start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=NEVER,
        wd_incr_style="constant",
    )


SYNC_HOOKS = ("grad_sync_func", "no_sync_func", "finalize_model_grads_func")


class SyncHooks:
    """The model config's sync hooks. Megatron's schedules call them
    themselves, so an open step nulls them (the trainer reduces once per
    optimizer step) and restores them when it ends."""

    def __init__(self, config, model, ddp):
        from megatron.core.distributed import finalize_model_grads

        self.config = config
        # What a plain Megatron training loop installs.
        config.no_sync_func = model.no_sync
        config.grad_sync_func = model.start_grad_sync if ddp.overlap_grad_reduce else None
        config.finalize_model_grads_func = finalize_model_grads
        self._saved: dict | None = None

    def null(self) -> None:
        self._saved = {name: getattr(self.config, name) for name in SYNC_HOOKS}
        self.config.grad_sync_func = None
        self.config.finalize_model_grads_func = None
        self.config.no_sync_func = contextlib.nullcontext

    def restore(self) -> None:
        if self._saved is None:
            return
        for name, hook in self._saved.items():
            setattr(self.config, name, hook)
        self._saved = None


def moe_aux_loss_metrics(config, pipeline_microbatches: int) -> dict[str, float]:
    """Each auxiliary loss per MoE layer and pipeline microbatch: Megatron's
    tracker sums it over an optimizer step's microbatches, one slot per layer
    (dense layers stay 0 and are left out of the mean)."""
    if not getattr(config, "num_moe_experts", None):
        return {}
    from megatron.core.transformer.moe import moe_utils

    moe_utils.reduce_aux_losses_tracker_across_ranks()
    microbatches = max(pipeline_microbatches, 1)
    metrics = {}
    for name, entry in moe_utils.get_moe_layer_wise_logging_tracker().items():
        per_layer = entry["values"].float()
        recorded = per_layer[per_layer != 0]
        metrics[f"moe/{name}"] = float(recorded.mean()) / microbatches if recorded.numel() else 0.0
    moe_utils.clear_aux_losses_tracker()
    return metrics
