"""Process groups, device meshes and ``fully_shard`` for the fsdp engine.

Every repeated layer (the children of each ``nn.ModuleList``: tiny-lm's
``blocks``, a Hugging Face model's ``model.layers``) is its own FSDP unit,
then the root takes what is left (embeddings, final norm, a tied or untied
head), so one layer's full parameters are live at a time.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MESH_DIMS = ("replicate", "shard")


def training_device() -> torch.device:
    """This process's GPU when there is one (``LOCAL_RANK`` picks it), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def ensure_process_group(device: torch.device) -> None:
    """FSDP needs torch.distributed even on one process: create a one-process
    group when the worker joined none (a single-rank trainer)."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_mesh(process_group, shard: int, device_type: str) -> DeviceMesh:
    """A 1D mesh (full shard) when ``shard`` is 0 or the group's size, else the
    2D (replicate, shard) mesh of hybrid sharding: ranks [k*shard, (k+1)*shard)
    hold one full copy between them."""
    group = process_group or dist.group.WORLD
    size = dist.get_world_size(group)
    if shard in (0, size):
        return DeviceMesh.from_group(group, device_type)
    if shard < 0 or size % shard:
        raise ValueError(f"fsdp: shard={shard} must divide the trainer's {size} data-parallel ranks")
    if size != dist.get_world_size():
        raise ValueError("fsdp: hybrid sharding (shard < ranks) needs the trainer's group to be the default group")
    return init_device_mesh(device_type, (size // shard, shard), mesh_dim_names=MESH_DIMS)


def shard_module(module: nn.Module, mesh: DeviceMesh, dtype: str) -> None:
    """``fully_shard`` every layer, then the root. bf16 computes in bf16 but
    keeps fp32 sharded parameters (the optimizer's master copy) and reduces
    gradients in fp32."""
    policy = mixed_precision(dtype)
    for layer in repeated_layers(module):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    for unit in fsdp_units(module):
        # Sum, not average, over ranks: the trainer divides by the global
        # token (or sequence) count itself, as the torch engine does.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        # Within a mini-batch the parameters stay gathered: a forward that
        # all-gathers would be a collective, and ranks run different numbers
        # of microbatches and forwards (trainer.py gathers once per mini-batch).
        unit.set_reshard_after_forward(False)
        unit.set_reshard_after_backward(False)


def unshard_all(module: nn.Module) -> None:
    """Gather every unit's full parameters (a collective, same order on every rank)."""
    for unit in fsdp_units(module):
        unit.unshard()


def reshard_all(module: nn.Module) -> None:
    """Free the gathered parameters (local, no communication)."""
    for unit in fsdp_units(module):
        unit.reshard()


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    if dtype not in DTYPES:
        raise ValueError(f"fsdp: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)


def repeated_layers(module: nn.Module) -> list[nn.Module]:
    return [layer for child in module.modules() if isinstance(child, nn.ModuleList) for layer in child]


def fsdp_units(module: nn.Module) -> list[FSDPModule]:
    return [unit for unit in module.modules() if isinstance(unit, FSDPModule)]


def drop_unreduced_grads(module: nn.Module) -> None:
    """Forget gradients accumulated without sync and not yet reduce-scattered
    (an aborted step's). FSDP keeps them on its internal unsharded
    parameters, which ``zero_grad`` does not reach."""
    for unit in fsdp_units(module):
        group = unit._get_fsdp_state()._fsdp_param_group
        for param in group.fsdp_params if group is not None else ():
            param.unsharded_accumulated_grad = None
            if hasattr(param, "_unsharded_param"):
                param._unsharded_param.grad = None
