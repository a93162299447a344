"""``TorchTrainer``: the split-step trainer of the torch engine.

A step is one rollout batch (one weight version), taken in one or more
optimizer steps:

- ``begin_train_step(step)`` zeroes the gradients and opens the step;
- ``train_microbatch(step, batch)`` runs forward + backward on the loss's
  UN-normalised sum, so ``.grad`` holds raw d(sum)/dθ, and adds the local
  token and sequence counts;
- ``optimizer_step(step)`` (a mini-batch boundary, optional) all-reduces the
  counts over data-parallel ranks to get the global N, rescales every
  gradient by 1/N, all-reduces the gradients once, clips, takes one AdamW
  step at the schedule's learning rate, then zeroes the gradients and the
  sums; the step stays open and the version is unchanged;
- ``finish_train_step(step)`` does the same for the last mini-batch and
  bumps the version by one, however many optimizer steps the batch took.

Since the loss is linear in 1/N, each optimizer step equals one backward
over its whole global mini-batch of the normalised loss, however the rows
were split into microbatches, forwards and ranks.

Data parallelism uses a manual all-reduce of one flat gradient buffer per
optimizer step rather than DDP + ``no_sync``: the controller streams
microbatches and only knows a mini-batch is complete when it calls
``optimizer_step`` or finish, so there is no "last microbatch" for DDP to
reduce in, and ranks may see different numbers of microbatches (DDP's hooks
would then mismatch). One reduce per optimizer step is also all DDP would do.

An optimizer step with no tokens on any rank is skipped. A finish whose
rollout batch took no optimizer step at all closes the step with the version
unchanged and the metrics saying ``skipped``. The gradients of the last
finished step stay in ``.grad`` until the next begin (tests read them).

Forwards: ``rows_per_forward`` rows each, or with ``tokens_per_forward`` as
many rows as fit the token budget (``packing.py``), packed into one
sequence without padding.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from rldsl.runtime.engines.policy_loss import (
    STAT_NAMES,
    PolicyLossConfig,
    policy_loss,
    rollout_metrics,
    step_metrics,
)
from rldsl.runtime.engines.schedule import LRSchedule
from rldsl.runtime.engines.torch.common import (
    packed_response_logprobs,
    response_logprobs,
    state_buckets,
)
from rldsl.runtime.engines.torch.packing import forward_rows, take_rows, trim_padding
from rldsl.runtime.protocols import (
    FIELD_ADVANTAGE,
    FIELD_BEHAVIOUR_LOGPROBS,
    FIELD_REF_LOGPROBS,
    FIELD_RESPONSE_MASK,
    Batch,
    StepResult,
)

log = logging.getLogger(__name__)
CHECKPOINT_FILE = "torch.pt"
SUMMED_STATS = ("loss_sum",) + STAT_NAMES
SKIPPED = {"skipped": 1.0}


class TorchTrainer:
    def __init__(
        self,
        model,
        loss: PolicyLossConfig | dict | None = None,
        lr: float = 5e-4,  # measured on builtin:tiny-lm; far too high for pretrained HF models
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        rows_per_forward: int | None = None,
        tokens_per_forward: int = 0,
        lr_schedule: LRSchedule | None = None,
        process_group=None,
    ):
        self.model = model
        self.loss = loss if isinstance(loss, PolicyLossConfig) else PolicyLossConfig(**(loss or {}))
        self.max_grad_norm = max_grad_norm
        self.rows_per_forward = rows_per_forward  # bounds activation memory per backward
        self.tokens_per_forward = tokens_per_forward  # 0: off; else the token budget of a forward
        self.process_group = process_group
        self.parameters = [p for p in model.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=lr, betas=betas, weight_decay=weight_decay)
        self.base_lr = lr
        self.lr_schedule = lr_schedule or LRSchedule()
        self.lr_schedule.check_base_lr(lr)
        self.optimizer_steps = 0  # over the whole run: the schedule's clock, kept in checkpoints
        self.version = 0
        self._open_step: int | None = None
        self._sums: dict[str, float] = {}
        self._taken: list[dict[str, float]] = []  # metrics of the open step's optimizer steps
        # Dropout stays off: the trainer's logprobs must equal the generator's
        # for the same weights, or the importance ratio is noise. Gradients
        # flow the same in eval mode.
        model.module.eval()

    # -- the split-step protocol -------------------------------------------------

    def begin_train_step(self, step: int) -> None:
        if self._open_step is not None:
            raise RuntimeError(f"begin_train_step({step}) while step {self._open_step} is open; finish or abort it")
        self._zero_grads()
        self._sums = dict.fromkeys(SUMMED_STATS, 0.0)
        self._taken = []
        self._open_step = step

    def train_microbatch(self, step: int, batch: Batch) -> dict[str, float]:
        """Forward + backward of the un-normalised loss sum; returns local sums."""
        self._require_open(step, "train_microbatch")
        sums = dict.fromkeys(SUMMED_STATS, 0.0)
        for rows in forward_rows(batch, self.rows_per_forward, self.tokens_per_forward):
            result = self._loss_sums(take_rows(batch, rows))
            if result.loss_sum.requires_grad:  # a forward without response tokens has nothing to learn
                result.loss_sum.backward()
            sums["loss_sum"] += float(result.loss_sum.detach())
            for name, value in result.stats.items():
                sums[name] += value
        for name, value in sums.items():
            self._sums[name] += value
        return sums

    def optimizer_step(self, step: int) -> dict[str, float]:
        """One optimizer step on the mini-batch trained since the last one; the
        step stays open and the version is unchanged. A collective."""
        self._require_open(step, "optimizer_step")
        metrics = self._take_optimizer_step()
        self._zero_grads()
        return metrics or dict(SKIPPED)

    def finish_train_step(self, step: int) -> StepResult:
        """The rollout batch's last optimizer step; bumps the version once."""
        self._require_open(step, "finish_train_step")
        self._take_optimizer_step()
        self._open_step = None
        if not self._taken:
            return StepResult(self.version, dict(SKIPPED))
        self.version += 1
        return StepResult(self.version, rollout_metrics(self._taken))

    def abort_train_step(self, step: int) -> None:
        """Drop the open step (whichever it is) and its gradients; safe to repeat."""
        if self._open_step is not None and self._open_step != step:
            log.warning("abort_train_step(%s) dropped open step %s", step, self._open_step)
        self._zero_grads()
        self._open_step = None
        self._sums = {}
        self._taken = []

    def weight_buckets(self, bucket_bytes: int):
        return state_buckets(self.model.module, bucket_bytes)

    # -- checkpoints -------------------------------------------------------------

    def save_checkpoint(self, directory) -> None:
        """Model, optimizer and version in ``directory/torch.pt``, written by
        rank 0 only: data-parallel replicas hold the same state."""
        from rldsl.runtime.atomic import save_torch_state

        if self._open_step is not None:
            raise RuntimeError(f"save_checkpoint while step {self._open_step} is open; finish or abort it")
        if self.process_group is None or dist.get_rank(self.process_group) == 0:
            state = {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "version": self.version, "optimizer_steps": self.optimizer_steps}
            save_torch_state(Path(directory) / CHECKPOINT_FILE, state)

    def load_checkpoint(self, directory) -> int:
        """Every rank loads the same file; returns the version."""
        from rldsl.runtime.atomic import load_torch_state

        state = load_torch_state(Path(directory) / CHECKPOINT_FILE)
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
        self.optimizer_steps = state.get("optimizer_steps", 0)
        return self.version

    # -- helpers -----------------------------------------------------------------

    def _require_open(self, step: int, call: str) -> None:
        if self._open_step is None:
            raise RuntimeError(f"{call}({step}) without an open step; call begin_train_step first")
        if self._open_step != step:
            raise RuntimeError(f"{call}({step}) but the open step is {self._open_step}")

    def _take_optimizer_step(self) -> dict[str, float] | None:
        """Reduce, scale, clip and step on the sums since the last optimizer
        step; None (nothing taken) when no rank had a token."""
        totals = self._global_sums()
        self._sums = dict.fromkeys(SUMMED_STATS, 0.0)
        count = totals[self.loss.count_name]
        if count == 0:
            return None
        self._reduce_and_scale_grads(count)
        grad_norm = self._clip()
        lr = self.lr_schedule.lr_at(self.optimizer_steps, self.base_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer_steps += 1
        self._taken.append(step_metrics(totals, count, grad_norm, lr))
        return self._taken[-1]

    def _loss_sums(self, batch: Batch):
        if self.tokens_per_forward:
            batch = trim_padding(batch)
            logprobs = packed_response_logprobs(self.model, batch)
        else:
            logprobs = response_logprobs(self.model, batch)
        device = logprobs.device
        ref = batch.get(FIELD_REF_LOGPROBS)
        return policy_loss(
            logprobs,
            batch[FIELD_BEHAVIOUR_LOGPROBS].to(device),
            batch[FIELD_ADVANTAGE].to(device),
            batch[FIELD_RESPONSE_MASK].to(device),
            self.loss,
            None if ref is None else ref.to(device),
        )

    def _zero_grads(self) -> None:
        for param in self.parameters:
            param.grad = None

    def _data_parallel(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def _global_sums(self) -> dict[str, float]:
        values = torch.tensor([self._sums[name] for name in SUMMED_STATS], dtype=torch.float64)
        if self._data_parallel():
            dist.all_reduce(values, group=self.process_group)
        return dict(zip(SUMMED_STATS, values.tolist()))

    def _reduce_and_scale_grads(self, count: float) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.parameters]
        if self._data_parallel():
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(count)
            dist.all_reduce(flat, group=self.process_group)
            grads = list(torch.split(flat, [g.numel() for g in grads]))
            for param, grad in zip(self.parameters, grads):
                param.grad = grad.view_as(param)
        else:
            for param, grad in zip(self.parameters, grads):
                param.grad = grad.div_(count)

    def _clip(self) -> float:
        norm_limit = self.max_grad_norm if self.max_grad_norm else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.parameters, norm_limit))
