"""``FsdpTrainer``: the split-step trainer over FSDP2-sharded parameters.

The protocol and its arithmetic are the torch engine's (``TorchTrainer``,
whose docstring explains why an optimizer step equals one backward over its
whole global mini-batch); only where the gradients live changes:

- ``begin_train_step`` (and each ``optimizer_step`` that leaves the step
  open) all-gathers the parameters once; they stay gathered for the whole
  mini-batch, so a microbatch runs no collective at all. That is what lets
  ranks train different numbers of microbatches and forwards (uneven
  lanes, token-budget packing, an idle rank): FSDP's usual per-layer
  all-gather in every forward would deadlock them. The cost is one full
  copy of the parameters (in the compute dtype) during a step;
- microbatches run with ``set_requires_gradient_sync(False)``: FSDP keeps
  each rank's raw d(sum)/dθ in full (unsharded) gradients and reduces
  nothing;
- ``optimizer_step`` / ``finish_train_step`` all-reduce the counts (global
  N), then run one tiny forward and a zero-valued backward with sync back
  on: FSDP adds the accumulated gradients to that zero gradient and
  reduce-scatters the sum (the divide factor is 1, so it is a sum; hybrid
  sharding also all-reduces it over the replicas). Every rank takes part,
  idle ones included, which is why the controller's "this mini-batch is
  complete" call is the only place a reduction can happen. Then the
  sharded gradients are divided by N, clipped (the norm is global over the
  shards), the gathered parameters are freed and AdamW steps on the shards
  at the schedule's learning rate.

``shard`` is the number of ranks a parameter is split over: 0 (or the rank
count) shards over all ranks; a divisor ``s`` of the ranks is hybrid
sharding (HSDP) over a (ranks/s, s) mesh: each group of ``s`` ranks holds
one copy.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from rldsl.runtime.engines.fsdp.sharding import (
    build_mesh,
    drop_unreduced_grads,
    ensure_process_group,
    reshard_all,
    shard_module,
    training_device,
    unshard_all,
)
from rldsl.runtime.engines.fsdp.state import (
    Offloaded,
    full_state_buckets,
    load_full_checkpoint,
    save_full_checkpoint,
)
from rldsl.runtime.engines.torch.train import TorchTrainer
from rldsl.runtime.protocols import Batch


class FsdpTrainer(TorchTrainer):
    def __init__(self, model, shard: int = 0, dtype: str = "fp32", offload: bool = True, process_group=None,
                 **options):
        device = training_device()
        ensure_process_group(device)
        model.module.to(device=device, dtype=torch.float32)  # fp32 master shards whatever the compute dtype
        self.mesh = build_mesh(process_group, shard, device.type)
        shard_module(model.module, self.mesh, dtype)
        self.dtype = dtype
        self.offload = offload
        self.offloaded = Offloaded()
        super().__init__(model, process_group=process_group, **options)

    # -- the split-step protocol (reductions moved to the mini-batch boundary) ---

    def begin_train_step(self, step: int) -> None:
        self._require_awake("begin_train_step")
        super().begin_train_step(step)
        self.model.module.set_requires_gradient_sync(False)
        unshard_all(self.model.module)

    def optimizer_step(self, step: int) -> dict[str, float]:
        metrics = super().optimizer_step(step)
        unshard_all(self.model.module)  # the next mini-batch's forwards see the new weights
        return metrics

    def abort_train_step(self, step: int) -> None:
        super().abort_train_step(step)
        reshard_all(self.model.module)

    def train_microbatch(self, step: int, batch: Batch) -> dict[str, float]:
        self._require_awake("train_microbatch")
        return super().train_microbatch(step, batch)

    def weight_buckets(self, bucket_bytes: int):
        """Full (unsharded) tensors under the torch engine's (Hugging Face)
        names, as CPU copies. A collective: every rank iterates it; only the
        first rank yields buckets."""
        self._require_awake("weight_buckets")
        return full_state_buckets(self.model.module, bucket_bytes)

    # -- checkpoints and offload -------------------------------------------------

    def save_checkpoint(self, directory) -> None:
        """Full model and optimizer state gathered to rank 0, which writes
        ``directory/fsdp.pt`` (with version and optimizer steps). A collective."""
        self._require_idle("save_checkpoint")
        save_full_checkpoint(directory, self.model.module, self.optimizer,
                             {"version": self.version, "optimizer_steps": self.optimizer_steps})

    def load_checkpoint(self, directory) -> int:
        """Every rank reads the file and keeps its shards (any rank count or
        ``shard`` may load it); returns the version."""
        self._require_idle("load_checkpoint")
        counters = load_full_checkpoint(directory, self.model.module, self.optimizer)
        self.version = counters["version"]
        self.optimizer_steps = counters.get("optimizer_steps", 0)
        return self.version

    def sleep(self) -> None:
        """With offload: sharded parameters and optimizer state to host
        memory; the last step's gradients are dropped (the next begin would
        drop them anyway). Idempotent; a no-op without offload."""
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

    # -- helpers -----------------------------------------------------------------

    def _require_idle(self, call: str) -> None:
        if self._open_step is not None:
            raise RuntimeError(f"{call} while step {self._open_step} is open; finish or abort it first")

    def _require_awake(self, call: str) -> None:
        if self.offloaded.asleep:
            raise RuntimeError(f"{call} while the trainer is asleep (offloaded); call wake first")

    def _zero_grads(self) -> None:
        drop_unreduced_grads(self.model.module)
        super()._zero_grads()

    def _take_optimizer_step(self) -> dict[str, float] | None:
        metrics = super()._take_optimizer_step()
        reshard_all(self.model.module)  # also after a skipped step: finish leaves nothing gathered
        return metrics

    def _reduce_and_scale_grads(self, count: float) -> None:
        self._reduce_scatter_accumulated()
        reshard_all(self.model.module)  # the optimizer updates the shards; gathered copies go stale
        for param in self.parameters:
            if param.grad is None:  # unused by every forward: AdamW still steps it, as in the torch engine
                param.grad = torch.zeros_like(param)
            else:
                param.grad.div_(count)

    def _reduce_scatter_accumulated(self) -> None:
        """One forward of a single token and a backward of zero times its
        logits with gradient sync on: FSDP reduce-scatters the gradients
        accumulated since the last reduction (plus exact zeros)."""
        root = self.model.module
        root.set_requires_gradient_sync(True)
        try:
            token = torch.zeros((1, 1), dtype=torch.long, device=self.model.device)
            logits, _ = self.model.forward(token, None, token, use_cache=False)
            (logits.float().sum() * 0.0).backward()
        finally:
            root.set_requires_gradient_sync(False)

    def _clip(self) -> float:
        norm_limit = self.max_grad_norm if self.max_grad_norm else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, norm_limit)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
