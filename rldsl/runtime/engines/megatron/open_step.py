"""The megatron trainer's open step: the sums since its last optimizer step,
the metrics of the optimizer steps it took and those it holds for finish."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rldsl.runtime.engines.policy_loss import EXTREME_STATS, merge_stats, no_stats, reduce_extremes
from rldsl.runtime.protocols import Batch, trained_tokens

COUNTS = ("tokens", "sequences")
# ``loss_count``: the loss's own count (PolicyLossConfig.count_name); ``engine_*``: the generator against
# the trainer on the same weights (policy_loss.engine_mismatch_stats)
LOSS_STATS = ("loss_sum", "kl_sum", "clipped_tokens", "dual_clipped_tokens", "capped_tokens", "ratio_sum",
              "mismatch_kl_sum", "mismatch_k3_sum", "mismatch_ratio_sum", "engine_tokens", "engine_abs_diff_sum",
              "engine_k3_sum", "loss_count")


def no_sums() -> dict[str, float]:
    """Zero sums and empty extremes (``EXTREME_STATS``, combined by max / min)."""
    empty = no_stats()
    return {**dict.fromkeys(COUNTS + LOSS_STATS, 0.0), **{name: empty[name] for name in EXTREME_STATS}}


def counted(chunks: list[Batch]) -> dict[str, float]:
    """No sums but the chunks' trained token and sequence counts."""
    sums = no_sums()
    for chunk in chunks:
        trained = trained_tokens(chunk)  # an environment's tokens are context, not trained
        sums["tokens"] += float(trained.sum())
        sums["sequences"] += float((trained.sum(dim=1) > 0).sum())
    return sums


@dataclass
class HeldSteps:
    """Optimizer steps waiting for finish (the proximal pass, ``proximal.py``)."""

    sums: dict[str, float]  # the first mini-batch's, whose gradients are in the grad buffers
    pipeline_microbatches: int
    # Each later mini-batch: its train_microbatch calls, each the pipeline microbatches of one schedule.
    later: list[list[list[Batch]]] = field(default_factory=lambda: [[]])


@dataclass
class OpenStep:
    step: int
    sums: dict[str, float] = field(default_factory=no_sums)  # since the last optimizer step
    pipeline_microbatches: int = 0  # since the last optimizer step
    taken: list[dict[str, float]] = field(default_factory=list)  # metrics of its optimizer steps
    held: HeldSteps | None = None
    failed: bool = False

    def add(self, sums: dict[str, float], pipeline_microbatches: int) -> None:
        merge_stats(self.sums, sums)
        self.pipeline_microbatches += pipeline_microbatches

    def restart_sums(self) -> tuple[dict[str, float], int]:
        """The sums and pipeline microbatches since the last optimizer step, then zero."""
        since = self.sums, self.pipeline_microbatches
        self.sums, self.pipeline_microbatches = no_sums(), 0
        return since


def global_sums(sums: dict[str, float], device) -> dict[str, float]:
    """Counts summed over data-parallel ranks; loss statistics also over
    pipeline stages (only the last stage computes the loss); the extremes by
    a MAX over both (a minimum as the max of its negation)."""
    from megatron.core import parallel_state

    counts = torch.tensor([sums[name] for name in COUNTS], dtype=torch.float64, device=device)
    stats = torch.tensor([sums[name] for name in LOSS_STATS], dtype=torch.float64, device=device)
    groups = []
    if dist.get_world_size() > 1:
        groups = [parallel_state.get_data_parallel_group(), parallel_state.get_pipeline_model_parallel_group()]
        dist.all_reduce(counts, group=groups[0])
    for group in groups:
        dist.all_reduce(stats, group=group)
    return {**dict(zip(COUNTS + LOSS_STATS, counts.tolist() + stats.tolist())),
            **reduce_extremes(sums, groups, device)}
