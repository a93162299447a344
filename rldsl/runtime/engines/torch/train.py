"""``TorchTrainer``: the split-step trainer of the torch engine.

One step is one optimizer step:

- ``begin_train_step(step)`` zeroes the gradients and opens the step;
- ``train_microbatch(step, batch)`` runs forward + backward on the loss's
  UN-normalised sum, so ``.grad`` holds raw d(sum)/dθ, and adds the local
  token and sequence counts;
- ``finish_train_step(step)`` all-reduces the counts over data-parallel ranks
  to get the global N, rescales every gradient by 1/N, all-reduces the
  gradients once, clips, takes one AdamW step and bumps the version.

Since the loss is linear in 1/N, the result equals one backward over the
whole global batch of the normalised loss, however the rows were split.

Data parallelism uses a manual all-reduce of one flat gradient buffer at
finish rather than DDP + ``no_sync``: the controller streams microbatches and
only knows a step is complete when it calls finish, so there is no "last
microbatch" for DDP to reduce in, and ranks may see different numbers of
microbatches (DDP's hooks would then mismatch). One reduce per step is also
all DDP would do here.

A finish with no tokens on any rank is a no-op that closes the step: no
optimizer step, the version is unchanged and the metrics say ``skipped``.
The gradients of the last finished step stay in ``.grad`` until the next
begin (tests read them).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from rldsl.runtime.engines.grpo_loss import GRPOLossConfig, grpo_loss, step_metrics
from rldsl.runtime.engines.torch.common import response_logprobs, split_rows, state_buckets
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
SUMMED_STATS = ("loss_sum", "tokens", "sequences", "kl_sum", "clipped_tokens", "ratio_sum")


class TorchTrainer:
    def __init__(
        self,
        model,
        loss: GRPOLossConfig | dict | None = None,
        lr: float = 5e-4,  # measured on builtin:tiny-lm; far too high for pretrained HF models
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        rows_per_forward: int | None = None,
        process_group=None,
    ):
        self.model = model
        self.loss = loss if isinstance(loss, GRPOLossConfig) else GRPOLossConfig(**(loss or {}))
        self.max_grad_norm = max_grad_norm
        self.rows_per_forward = rows_per_forward  # bounds activation memory per backward
        self.process_group = process_group
        self.parameters = [p for p in model.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=lr, betas=betas, weight_decay=weight_decay)
        self.version = 0
        self._open_step: int | None = None
        self._sums: dict[str, float] = {}
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
        self._open_step = step

    def train_microbatch(self, step: int, batch: Batch) -> dict[str, float]:
        """Forward + backward of the un-normalised loss sum; returns local sums."""
        self._require_open(step, "train_microbatch")
        sums = dict.fromkeys(SUMMED_STATS, 0.0)
        for chunk in split_rows(batch, self.rows_per_forward):
            result = self._loss_sums(chunk)
            result.loss_sum.backward()
            sums["loss_sum"] += float(result.loss_sum.detach())
            for name, value in result.stats.items():
                sums[name] += value
        for name, value in sums.items():
            self._sums[name] += value
        return sums

    def finish_train_step(self, step: int) -> StepResult:
        self._require_open(step, "finish_train_step")
        totals = self._global_sums()
        count = totals["tokens" if self.loss.level == "token" else "sequences"]
        if count == 0:
            self._open_step = None
            return StepResult(self.version, {"skipped": 1.0})
        self._reduce_and_scale_grads(count)
        grad_norm = self._clip()
        self.optimizer.step()
        self.version += 1
        self._open_step = None
        return StepResult(self.version, self._step_metrics(totals, count, grad_norm))

    def abort_train_step(self, step: int) -> None:
        """Drop the open step (whichever it is) and its gradients; safe to repeat."""
        if self._open_step is not None and self._open_step != step:
            log.warning("abort_train_step(%s) dropped open step %s", step, self._open_step)
        self._zero_grads()
        self._open_step = None
        self._sums = {}

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
                     "version": self.version}
            save_torch_state(Path(directory) / CHECKPOINT_FILE, state)

    def load_checkpoint(self, directory) -> int:
        """Every rank loads the same file; returns the version."""
        from rldsl.runtime.atomic import load_torch_state

        state = load_torch_state(Path(directory) / CHECKPOINT_FILE)
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
        return self.version

    # -- helpers -----------------------------------------------------------------

    def _require_open(self, step: int, call: str) -> None:
        if self._open_step is None:
            raise RuntimeError(f"{call}({step}) without an open step; call begin_train_step first")
        if self._open_step != step:
            raise RuntimeError(f"{call}({step}) but the open step is {self._open_step}")

    def _loss_sums(self, batch: Batch):
        logprobs = response_logprobs(self.model, batch)
        device = logprobs.device
        ref = batch.get(FIELD_REF_LOGPROBS)
        return grpo_loss(
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

    def _step_metrics(self, totals: dict[str, float], count: float, grad_norm: float) -> dict[str, float]:
        return step_metrics(totals, count, grad_norm, self.optimizer.param_groups[0]["lr"])
