"""``MegatronTrainer``'s state outside a step: checkpoints and offload.

Checkpoints are the trainer's own format, one file per rank::

    DIRECTORY/megatron/rank00000.pt    {"layout", "experts", "distributed_optimizer", "version",
    DIRECTORY/megatron/rank00001.pt     "model", "optimizer", "optimizer_param_state", "scheduler"}

``model`` is the rank's local ``GPTModel.state_dict()`` (its tensor- and
pipeline-parallel shard). ``optimizer`` is the Megatron optimizer's
``state_dict()``; with the distributed optimizer that holds only the
parameter groups, and ``optimizer_param_state`` holds, per distributed
sub-optimizer, this rank's shard of main parameters and Adam moments
(``get_parameter_state_dp_reshardable``: the rank's buffers as they are, no
gather). ``layout`` is ``{tp, pp, dp, world_size, rank}`` and ``experts``
the rank's expert-parallel place ``{ep, etp, ep_rank, etp_rank}``; a file is
only read back under the same layout (no resharding). Files are written to a
``.tmp`` and renamed, and read with ``torch.load(weights_only=True)``.

Offload (``DeviceOffload``) frees the device memory behind the weights, the
gradient buffers and the optimizer state without replacing any tensor: it
copies each storage to host memory (pinned on CUDA) and resizes the device
storage to 0 bytes, so every view into it (``param.data`` into DDP's
contiguous param buffer, ``param.main_grad`` into its grad buffer, the
optimizer's shards) stays the same Python object; waking resizes the
storage back and copies the bytes in. Gradients are not copied: between
steps they are dead (``begin_train_step`` zeroes them), so they come back
as zeros.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from rldsl.runtime.atomic import save_torch_state

CHECKPOINT_SUBDIR = "megatron"


# -- checkpoints ------------------------------------------------------------------


def checkpoint_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / CHECKPOINT_SUBDIR / f"rank{rank:05d}.pt"


def current_layout() -> dict[str, int]:
    from megatron.core import parallel_state

    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "world_size": dist.get_world_size(),
        "rank": dist.get_rank(),
    }


def expert_layout() -> dict[str, int]:
    """This rank's place among a mixture of experts' ranks (for a dense model ep = 1 and etp = tp): the
    export of a checkpoint finds every expert's shards by it."""
    from megatron.core import parallel_state

    return {"ep": parallel_state.get_expert_model_parallel_world_size(),
            "etp": parallel_state.get_expert_tensor_parallel_world_size(),
            "ep_rank": parallel_state.get_expert_model_parallel_rank(),
            "etp_rank": parallel_state.get_expert_tensor_parallel_rank()}


def sub_optimizers(optimizer) -> list:
    """The optimizers inside Megatron's ``ChainedOptimizer`` (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _distributed(optimizer) -> list:
    return [sub for sub in sub_optimizers(optimizer) if hasattr(sub, "get_parameter_state_dp_reshardable")]


def save_checkpoint(directory, *, model, optimizer, scheduler, version: int, distributed_optimizer: bool) -> Path:
    """Write this rank's file (atomically), then wait for every rank's.
    A collective: every trainer rank must call it."""
    layout = current_layout()
    state = {
        "layout": layout,
        "experts": expert_layout(),
        "distributed_optimizer": distributed_optimizer,
        "version": version,
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "optimizer_param_state": [sub.get_parameter_state_dp_reshardable() for sub in _distributed(optimizer)],
        "scheduler": scheduler.state_dict(),
    }
    path = checkpoint_file(directory, layout["rank"])
    save_torch_state(path, state)  # never a half-written rank file
    if layout["world_size"] > 1:
        dist.barrier()  # on return, every rank's file is complete
    return path


@torch.no_grad()  # fp32 main-param shards are views of the parameters: copying into them needs no_grad
def load_checkpoint(directory, *, model, optimizer, scheduler, distributed_optimizer: bool) -> int:
    """Restore this rank's model, optimizer and scheduler; returns the version."""
    layout = current_layout()
    path = checkpoint_file(directory, layout["rank"])
    if not path.exists():
        raise FileNotFoundError(f"no Megatron checkpoint for rank {layout['rank']}: {path} does not exist "
                                f"(this trainer runs layout {layout})")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["layout"] != layout:
        raise RuntimeError(f"Megatron checkpoint {path} was saved with layout {state['layout']} but this trainer "
                           f"runs layout {layout}: resuming needs the same tp/pp/dp and world size "
                           f"(resharding is not supported)")
    saved, experts = state.get("experts"), expert_layout()  # files written before it: a layout not checked
    if saved and (saved["ep"], saved["etp"]) != (experts["ep"], experts["etp"]):
        raise RuntimeError(f"Megatron checkpoint {path} was saved with ep = {saved['ep']}, etp = {saved['etp']} but "
                           f"this trainer runs ep = {experts['ep']}, etp = {experts['etp']}: resuming needs the same "
                           f"expert layout (resharding is not supported)")
    if state["distributed_optimizer"] != distributed_optimizer:
        raise RuntimeError(f"Megatron checkpoint {path} was saved with distributed_optimizer="
                           f"{state['distributed_optimizer']}, this trainer has {distributed_optimizer}")
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    _reshape_placeholder_states(optimizer)
    for sub, param_state in zip(_distributed(optimizer), state["optimizer_param_state"], strict=True):
        for per_dtype in (v for k, v in param_state.items() if isinstance(k, int)):
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry.setdefault("padding", False)  # the loader skips padding entries; we saved none
        sub.load_parameter_state_from_dp_reshardable(param_state)
    _own_optimizer_storages(optimizer)
    scheduler.num_steps = 0  # load_state_dict ADDS the saved step count to the current one
    scheduler.load_state_dict(state["scheduler"])
    return int(state["version"])


def _reshape_placeholder_states(optimizer) -> None:
    """Give each placeholder state of the distributed optimizer its parameter's
    shape. Its ``load_state_dict`` allocates them (the parameter state loaded
    next overwrites every value), and in a parameter group that holds both
    bf16 and fp32 parameters it gives some parameters another's shape (a
    bf16 Qwen2 model: its 48-element q/k/v biases and 32-element norms swap),
    so that loading then fails on a size mismatch."""
    for sub in _distributed(optimizer):
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                states = sub.optimizer.state.get(param, {})
                for key, value in states.items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                        states[key] = torch.empty(param.shape, dtype=value.dtype, device=value.device)


def _own_optimizer_storages(optimizer) -> None:
    """Give every optimizer state tensor a storage of its own. torch's
    optimizers keep a loaded tensor as it is when it already has the
    parameter's device and dtype (on a CPU), and torch.load's storages cannot
    be resized, which offload needs. And without Apex or Transformer Engine
    the distributed optimizer's ``load_state_dict`` gives every parameter the
    SAME ``step`` tensor, which torch's Adam then increments once per
    parameter."""
    seen: set[int] = set()
    for inner in _inner_optimizers(optimizer):
        for per_param in inner.state.values():
            for key, value in per_param.items():
                if not torch.is_tensor(value):
                    continue
                storage = value.untyped_storage()
                if storage.data_ptr() in seen or not storage.resizable():
                    per_param[key] = value = value.clone()
                seen.add(value.untyped_storage().data_ptr())


def _inner_optimizers(optimizer) -> list:
    return [sub.optimizer for sub in sub_optimizers(optimizer) if getattr(sub, "optimizer", None) is not None]


# -- offload ----------------------------------------------------------------------


def offload_tensors(model, optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(kept, dropped): what sleep copies to the host, and the gradient
    buffers it frees. Kept: DDP's param buffers (the distributed optimizer
    maps ``param.data`` into them), every model parameter (the
    non-distributed optimizer leaves them unmapped), the optimizer's
    parameters (fp32 main params or their shards) and its state."""
    buffers = list(model.buffers) + list(model.expert_parallel_buffers)
    kept = [buffer.param_data for buffer in buffers if buffer.param_data is not None]
    kept += list(model.module.parameters())
    for inner in _inner_optimizers(optimizer):
        kept += [param for group in inner.param_groups for param in group["params"]]
        kept += [value for per_param in inner.state.values() for value in per_param.values() if torch.is_tensor(value)]
    return kept, [buffer.grad_data for buffer in buffers]


def _storages(tensors: Iterable[torch.Tensor], device: torch.device) -> dict[int, torch.UntypedStorage]:
    """The distinct non-empty storages on ``device``'s type behind ``tensors``."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.device.type == device.type and storage.nbytes() > 0:
            found.setdefault(storage.data_ptr(), storage)
    return found


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class DeviceOffload:
    """Sleep/wake by storage: see the module docstring. Both are idempotent."""

    def __init__(self):
        self._kept: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []
        self.asleep = False

    def sleep(self, kept: Iterable[torch.Tensor], dropped: Iterable[torch.Tensor], device: torch.device) -> None:
        if self.asleep:
            return
        keep = _storages(kept, device)
        drop = [storage for key, storage in _storages(dropped, device).items() if key not in keep]
        fixed = sum(not storage.resizable() for storage in [*keep.values(), *drop])
        if fixed:  # checked first: a storage freed and then a failure would leave dangling tensors
            raise RuntimeError(f"cannot offload: {fixed} storage(s) cannot be resized (memory-mapped or shared)")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # Copy everything before freeing anything: a failed host allocation leaves the trainer awake and intact.
        copies = []
        for storage in keep.values():
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(_bytes(storage))
            copies.append((storage, host))
        self._kept, self._dropped = copies, [(storage, storage.nbytes()) for storage in drop]
        for storage, _ in self._kept + self._dropped:
            storage.resize_(0)
        self.asleep = True
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if not self.asleep:
            return
        for storage, host in self._kept:
            if storage.nbytes() != host.numel():  # a retry after a failed wake skips what came back
                storage.resize_(host.numel())
                _bytes(storage).copy_(host)
        for storage, nbytes in self._dropped:
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
                _bytes(storage).zero_()
        self._kept, self._dropped, self.asleep = [], [], False


class CheckpointsAndOffload:
    """``MegatronTrainer``'s calls outside a step: its checkpoints and offload
    (it holds ``model``, ``optimizer``, ``scheduler``, ``ddp_config``,
    ``version``, ``offload``, ``_offload``, ``device`` and ``_open``)."""

    def save_checkpoint(self, directory) -> None:
        """A collective: every rank writes ``directory/megatron/rank{rank:05d}.pt``
        and, when it returns on any rank, every rank's file is written."""
        self._require_idle("save_checkpoint")
        save_checkpoint(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                           version=self.version, distributed_optimizer=self.ddp_config.use_distributed_optimizer)

    def load_checkpoint(self, directory) -> int:
        """This rank's file back (same tp/pp/dp layout only); returns the version."""
        self._require_idle("load_checkpoint")
        self.version = load_checkpoint(directory, model=self.model, optimizer=self.optimizer,
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
            self._offload.sleep(*offload_tensors(self.model, self.optimizer), self.device)

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
