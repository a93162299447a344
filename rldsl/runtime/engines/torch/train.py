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

The proximal pass: a loss with ``behaviour_cap`` or a ``correction`` weighs
each token by pi_prox / pi_behaviour, the proximal policy being the weights
the rollout batch started with. With one optimizer step per rollout batch
those are the weights every forward runs on. With several, the first
``optimizer_step`` call holds its step back (the first mini-batch's
gradients wait in ``.grad``): every later microbatch gets its proximal
logprobs from a no-grad forward on the still unchanged batch-start weights
and is kept (host memory: token ids and per-token floats); at
``finish_train_step`` the held optimizer steps run in order, each later
mini-batch trained against its kept proximal logprobs. A later pass
(``ppo_epochs``) sends the same rows again, and they get the same proximal
logprobs, the weights being still those of the batch start.

With ``offload`` (the default), ``sleep`` moves the weights and AdamW state
to host memory while colocated generators run and ``wake`` brings them back
bit for bit; a step, an export or a checkpoint is refused while asleep.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from rldsl.models.lora import adapters_off, load_trained_state, state_bytes, trained_state
from rldsl.runtime.engines.policy_loss import (
    STAT_NAMES,
    PolicyLossConfig,
    first_weights_mismatch,
    merge_stats,
    no_stats,
    policy_loss,
    reduce_extremes,
    rollout_metrics,
    step_metrics,
)
from rldsl.runtime.engines.schedule import LRSchedule
from rldsl.runtime.engines.torch.common import (
    packed_response_logprobs,
    response_logprobs,
    split_rows,
    state_buckets,
)
from rldsl.runtime.engines.torch.offload import Offloaded
from rldsl.runtime.engines.torch.packing import forward_rows, take_rows, trim_padding
from rldsl.runtime.protocols import (
    FIELD_ADVANTAGE,
    FIELD_BEHAVIOUR_LOGPROBS,
    FIELD_REF_LOGPROBS,
    Batch,
    StepResult,
    trained_tokens,
)

log = logging.getLogger(__name__)
CHECKPOINT_FILE = "torch.pt"
SUMMED_STATS = ("loss_sum",) + STAT_NAMES
SKIPPED = {"skipped": 1.0}
DEFERRED = {"deferred": 1.0}  # an optimizer step held back until finish (the proximal pass)


class TorchTrainer:
    # Every rank holds the whole model and reads it for an export with no
    # collective, and no forward swaps the parameters: an export may run
    # while the next step's microbatches do (handles.StageHandles.export_overlaps).
    exports_beside_steps = True

    def __init__(
        self,
        model,
        loss: PolicyLossConfig | dict | None = None,
        lr: float = 5e-4,  # measured on builtin:tiny-lm; far too high for pretrained HF models
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        rows_per_forward: int | None = None,
        tokens_per_forward: int = 0,
        lr_schedule: LRSchedule | None = None,
        process_group=None,
        offload: bool = True,
        temperature: float = 1.0,
    ):
        self.model = model
        self.temperature = temperature  # the generators' sampling temperature: logprobs are taken at it
        self.offload = offload
        self.offloaded = Offloaded()
        self.loss = loss if isinstance(loss, PolicyLossConfig) else PolicyLossConfig(**(loss or {}))
        self.max_grad_norm = max_grad_norm
        self.rows_per_forward = rows_per_forward  # bounds activation memory per backward
        self.tokens_per_forward = tokens_per_forward  # 0: off; else the token budget of a forward
        self.process_group = process_group
        self.parameters = [p for p in model.module.parameters() if p.requires_grad]  # with LoRA: the adapters
        self.push_bytes = state_bytes(trained_state(model.module))  # what a push of a version carries
        self.optimizer = torch.optim.AdamW(self.parameters, lr=lr, betas=tuple(betas), eps=eps,
                                           weight_decay=weight_decay)
        self.base_lr = lr
        self.lr_schedule = lr_schedule or LRSchedule()
        self.lr_schedule.check_base_lr(lr)
        self.optimizer_steps = 0  # over the whole run: the schedule's clock, kept in checkpoints
        self.version = 0
        self._open_step: int | None = None
        self._sums: dict[str, float] = {}
        self._taken: list[dict[str, float]] = []  # metrics of the open step's optimizer steps
        self._held_sums: dict[str, float] | None = None  # the first mini-batch's, its optimizer step held back
        self._deferred: list[list[tuple[Batch, torch.Tensor]]] | None = None  # later mini-batches' forwards
        # Dropout stays off: the trainer's logprobs must equal the generator's
        # for the same weights, or the importance ratio is noise. Gradients
        # flow the same in eval mode.
        model.module.eval()

    # -- the split-step protocol -------------------------------------------------

    def begin_train_step(self, step: int) -> None:
        self._require_awake(f"begin_train_step({step})")
        if self._open_step is not None:
            raise RuntimeError(f"begin_train_step({step}) while step {self._open_step} is open; finish or abort it")
        self._zero_grads()
        self._sums = _no_sums()
        self._taken = []
        self._held_sums, self._deferred = None, None
        self._open_step = step

    def train_microbatch(self, step: int, batch: Batch) -> dict[str, float]:
        """Forward + backward of the un-normalised loss sum; returns local sums."""
        self._require_open(step, "train_microbatch")
        forwards = [take_rows(batch, rows) for rows in forward_rows(batch, self.rows_per_forward,
                                                                     self.tokens_per_forward)]
        if self._deferred is not None:  # after a held optimizer step: proximal pass now, training at finish
            self._deferred[-1] += [(rows, self._proximal_logprobs(rows)) for rows in forwards]
            return _counts(batch)
        sums = _no_sums()
        for rows in forwards:
            merge_stats(sums, self._forward_backward_sums(rows))
        merge_stats(self._sums, sums)
        return sums

    def optimizer_step(self, step: int) -> dict[str, float]:
        """One optimizer step on the mini-batch trained since the last one; the
        step stays open and the version is unchanged. A collective."""
        self._require_open(step, "optimizer_step")
        if self.loss.needs_proximal:
            self._hold_optimizer_step()
            return dict(DEFERRED)
        metrics = self._take_optimizer_step()
        self._zero_grads()
        return metrics or dict(SKIPPED)

    def finish_train_step(self, step: int) -> StepResult:
        """The rollout batch's last optimizer step (and the held ones); bumps the version once."""
        self._require_open(step, "finish_train_step")
        if self._deferred is None:
            self._take_optimizer_step()
        else:
            self._take_held_optimizer_steps()
        self._open_step = None
        if not self._taken:
            return StepResult(self.version, dict(SKIPPED))
        self.version += 1
        return StepResult(self.version, {**rollout_metrics(self._taken), "push_bytes": float(self.push_bytes)})

    def abort_train_step(self, step: int) -> None:
        """Drop the open step (whichever it is) and its gradients; safe to repeat."""
        if self._open_step is not None and self._open_step != step:
            log.warning("abort_train_step(%s) dropped open step %s", step, self._open_step)
        self._zero_grads()
        self._open_step = None
        self._sums = {}
        self._taken = []
        self._held_sums, self._deferred = None, None

    streams_from_device = True  # weight_buckets(on_host=False): the weights where they are, for a stream

    def weight_buckets(self, bucket_bytes: int, on_host: bool = True):
        """Host copies (what the object store keeps); without ``on_host`` the
        weights themselves, on their device, for a collective stream that
        packs them there (valid until the next optimizer step)."""
        self._require_awake("weight_buckets")
        return state_buckets(self.model.module, bucket_bytes, on_host)

    @torch.no_grad()
    def reference_logprobs(self, batch) -> torch.Tensor:
        """A frozen reference's log-probabilities: this LoRA policy with its
        adapters off is the base (rldsl.models.lora.adapters_off), so no copy
        of the model is needed. Between two of this trainer's calls (its actor
        takes one at a time): the adapters are back before the next microbatch."""
        self._require_awake("reference_logprobs")
        with adapters_off(self.model.module):
            chunks = [response_logprobs(self.model, chunk, self.temperature).cpu()
                      for chunk in split_rows(batch, self.rows_per_forward)]
        return torch.cat(chunks) if chunks else torch.zeros(0, 0)

    # -- offload -------------------------------------------------------------------

    def sleep(self) -> None:
        """With offload: weights and AdamW state to host memory, the last
        step's gradients dropped (fsdp: the rank's shards). Idempotent; a
        no-op without offload."""
        self._require_idle("sleep")
        if self.offload and not self.offloaded.asleep:
            self._zero_grads()
            self.offloaded.sleep(self.model.module, self.optimizer)

    def wake(self) -> None:
        """Undo ``sleep``, bit for bit; idempotent."""
        self.offloaded.wake(self.model.module, self.optimizer)

    @property
    def asleep(self) -> bool:
        return self.offloaded.asleep

    # -- checkpoints -------------------------------------------------------------

    def save_checkpoint(self, directory) -> None:
        """Model (its LoRA adapters only, if it has them), optimizer and version
        in ``directory/torch.pt``, written by rank 0 only: data-parallel
        replicas hold the same state."""
        from rldsl.runtime.atomic import save_torch_state

        self._require_idle("save_checkpoint")
        self._require_awake("save_checkpoint")
        if self.process_group is None or dist.get_rank(self.process_group) == 0:
            state = {"model": trained_state(self.model.module), "optimizer": self.optimizer.state_dict(),
                     "version": self.version, "optimizer_steps": self.optimizer_steps}
            save_torch_state(Path(directory) / CHECKPOINT_FILE, state)

    def load_checkpoint(self, directory) -> int:
        """Every rank loads the same file; returns the version."""
        from rldsl.runtime.atomic import load_torch_state

        state = load_torch_state(Path(directory) / CHECKPOINT_FILE)
        load_trained_state(self.model.module, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
        self.optimizer_steps = state.get("optimizer_steps", 0)
        return self.version

    # -- helpers -----------------------------------------------------------------

    def _require_idle(self, call: str) -> None:
        if self._open_step is not None:
            raise RuntimeError(f"{call} while step {self._open_step} is open; finish or abort it first")

    def _require_awake(self, call: str) -> None:
        if self.offloaded.asleep:
            raise RuntimeError(f"{call} while the trainer is asleep (offloaded); call wake first")

    def _require_open(self, step: int, call: str) -> None:
        if self._open_step is None:
            raise RuntimeError(f"{call}({step}) without an open step; call begin_train_step first")
        if self._open_step != step:
            raise RuntimeError(f"{call}({step}) but the open step is {self._open_step}")

    # -- the proximal pass (module docstring) ------------------------------------

    def _hold_optimizer_step(self) -> None:
        """A mini-batch boundary whose optimizer step waits for finish, so the
        weights stay the batch-start ones for the proximal pass."""
        if self._deferred is None:  # the first mini-batch: its gradients wait in .grad
            self._train_pending()
            self._held_sums, self._sums = self._sums, _no_sums()
            self._deferred = [[]]
        else:
            self._keep_pending_with_proximal()
            self._deferred.append([])

    def _take_held_optimizer_steps(self) -> None:
        """The first mini-batch's optimizer step, then each later mini-batch
        trained against its proximal logprobs and stepped."""
        self._keep_pending_with_proximal()
        minibatches, self._deferred = self._deferred, None
        self._sums, self._held_sums = self._held_sums, None
        self._take_optimizer_step()
        for forwards in minibatches:
            self._zero_grads()
            self._train_forwards(forwards)
            self._take_optimizer_step()

    @torch.no_grad()
    def _proximal_logprobs(self, batch: Batch) -> torch.Tensor:
        return self._logprobs(batch)[1].cpu()

    def _train_forwards(self, forwards: list[tuple[Batch, torch.Tensor]]) -> None:
        for rows, proximal in forwards:
            merge_stats(self._sums, self._forward_backward_sums(rows, proximal))

    def _train_pending(self) -> None:
        """Microbatches kept for the boundary (the FSDP engine's): the torch engine trains on arrival."""

    def _keep_pending_with_proximal(self) -> None:
        """The FSDP engine's pending microbatches get their proximal logprobs here."""

    # -- helpers, continued ------------------------------------------------------

    def _forward_backward_sums(self, batch: Batch, proximal: torch.Tensor | None = None) -> dict[str, float]:
        result = self._loss_sums(batch, proximal)
        if result.loss_sum.requires_grad:  # a forward without response tokens has nothing to learn
            result.loss_sum.backward()
        return {"loss_sum": float(result.loss_sum.detach()), **result.stats}

    def _take_optimizer_step(self) -> dict[str, float] | None:
        """Reduce, scale, clip and step on the sums since the last optimizer
        step; None (nothing taken) when no rank had a token."""
        totals = self._global_sums()
        self._sums = _no_sums()
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

    def _logprobs(self, batch: Batch) -> tuple[Batch, torch.Tensor]:
        """The batch as the forward saw it (trimmed when packed) and its response logprobs."""
        if self.tokens_per_forward:
            batch = trim_padding(batch)
            return batch, packed_response_logprobs(self.model, batch, self.temperature)
        return batch, response_logprobs(self.model, batch, self.temperature)

    def _loss_sums(self, batch: Batch, proximal: torch.Tensor | None = None):
        batch, logprobs = self._logprobs(batch)
        device = logprobs.device
        ref = batch.get(FIELD_REF_LOGPROBS)
        behaviour, mask = batch[FIELD_BEHAVIOUR_LOGPROBS].to(device), trained_tokens(batch).to(device)
        result = policy_loss(
            logprobs,
            behaviour,
            batch[FIELD_ADVANTAGE].to(device),
            mask,  # an environment's tokens are context, not trained
            self.loss,
            None if ref is None else ref.to(device),
            None if proximal is None else proximal.to(device),
        )
        result.stats.update(first_weights_mismatch(batch, logprobs, proximal, behaviour, mask, self.version,
                                                   stepped=bool(self._taken)))
        return result

    def _zero_grads(self) -> None:
        for param in self.parameters:
            param.grad = None

    def _data_parallel(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def _global_sums(self) -> dict[str, float]:
        """Sums over data-parallel ranks; the extremes by a MAX (a minimum as the max of its negation)."""
        values = torch.tensor([self._sums[name] for name in SUMMED_STATS], dtype=torch.float64)
        groups = [self.process_group] if self._data_parallel() else []
        for group in groups:
            dist.all_reduce(values, group=group)
        return {**dict(zip(SUMMED_STATS, values.tolist())), **reduce_extremes(self._sums, groups)}

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


def _no_sums() -> dict[str, float]:
    return {"loss_sum": 0.0, **no_stats()}


def _counts(batch: Batch) -> dict[str, float]:
    """A microbatch's token and sequence counts, read off its response mask."""
    tokens_per_row = torch.as_tensor(trained_tokens(batch)).sum(dim=1)
    return {"tokens": float(tokens_per_row.sum()), "sequences": float((tokens_per_row > 0).sum())}
