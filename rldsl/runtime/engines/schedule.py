"""Learning-rate schedules, counted in optimizer steps.

``lr_at(k, base_lr)`` is the learning rate of the optimizer step taken after
``k`` steps: a linear warmup from ``warmup_start_lr`` (default 0) over ``warmup`` steps, then constant, or
a linear or cosine decay that reaches ``min_lr`` at step ``total`` (and stays
there). A run shorter than its warmup (``rldsl check`` warns, RLP311; a
``--steps`` override can do it) only ever warms up. The formulas are megatron-core's ``OptimizerParamScheduler`` ones
with ``init_lr = warmup_start_lr`` (and, from 0, Hugging Face's ``get_*_schedule_with_warmup``), so
the torch trainer and the megatron trainer follow the same curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    kind: str = "constant"
    warmup: int = 0  # optimizer steps of linear warmup from 0
    total: int = 0  # optimizer steps of the whole run; decay ends here (unused by "constant")
    min_lr: float = 0.0  # where "linear" and "cosine" decay to
    warmup_start_lr: float = 0.0  # the learning rate of the first warmup step

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"lr schedule {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.warmup < 0 or self.min_lr < 0 or self.warmup_start_lr < 0:
            raise ValueError(f"warmup {self.warmup}, min_lr {self.min_lr} and warmup_start_lr "
                             f"{self.warmup_start_lr} must be >= 0")

    @property
    def decays(self) -> bool:
        return self.kind != "constant"

    def check_base_lr(self, base_lr: float) -> None:
        if self.decays and self.min_lr > base_lr:
            raise ValueError(f"min_lr {self.min_lr} is above the learning rate {base_lr}")

    def lr_at(self, optimizer_step: int, base_lr: float) -> float:
        """The LR of the optimizer step taken after ``optimizer_step`` steps."""
        if optimizer_step < self.warmup:
            return self.warmup_start_lr + (base_lr - self.warmup_start_lr) * optimizer_step / self.warmup
        if not self.decays:
            return base_lr
        if optimizer_step >= self.total:
            return self.min_lr
        progress = (optimizer_step - self.warmup) / (self.total - self.warmup)
        if self.kind == "linear":
            coefficient = 1.0 - progress
        else:
            coefficient = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + coefficient * (base_lr - self.min_lr)
