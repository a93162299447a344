"""Process groups, device meshes and ``fully_shard`` for the fsdp engine.

Every repeated layer (the children of each ``nn.ModuleList``: tiny-lm's
``blocks``, a Hugging Face model's ``model.layers``) is its own FSDP unit,
then the root takes what is left (embeddings, final norm, a tied or untied
head), so one layer's full parameters are live at a time. Each repeated
layer also checkpoints its activations (``checkpoint_activations``): the
forward keeps only the layer's input, and the backward runs the layer's
forward again, on the parameters FSDP gathers for that backward anyway,
before differentiating it.
"""

from __future__ import annotations

import os
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from rldsl.runtime.engines.torch.common import init_one_process_group

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
    init_one_process_group(backend)


def build_mesh(process_group, shard: int, device_type: str) -> DeviceMesh:
    """A 1D mesh (full shard) when ``shard`` is 0 or the group's size, else the
    2D (replicate, shard) mesh of hybrid sharding: ranks [k*shard, (k+1)*shard)
    hold one full copy between them."""
    group = process_group or dist.group.WORLD
    size = dist.get_world_size(group)
    if shard in (0, size):
        return DeviceMesh.from_group(group, device_type)
    if shard < 0 or size % shard:
        raise ValueError(f"fsdp: shard={shard} must divide the stage's {size} data-parallel ranks")
    if size != dist.get_world_size():
        raise ValueError("fsdp: hybrid sharding (shard < ranks) needs the stage's group to be the default group")
    return init_device_mesh(device_type, (size // shard, shard), mesh_dim_names=MESH_DIMS)


def shard_module(module: nn.Module, mesh: DeviceMesh, dtype: str, frozen: bool = False) -> None:
    """``fully_shard`` every layer, then the root. ``frozen`` (a logprob
    stage's forward-only copy): the shards are already in the compute dtype,
    nothing is cast, checkpointed or reduced. Otherwise bf16 computes in bf16 but
    keeps fp32 sharded parameters (the optimizer's master copy) and reduces
    gradients in fp32. Each unit's full parameters are gathered for its
    forward and again for its backward, and freed after each (FSDP keeps the
    root's from its forward to its backward), so a rank holds the layers in
    flight, never the model; the trainer keeps every rank's forwards in
    lockstep so those per-layer all-gathers line up. Every layer checkpoints
    its activations, which the compiler's memory model assumes."""
    if frozen:
        for unit in [*repeated_layers(module), module]:
            fully_shard(unit, mesh=mesh, reshard_after_forward=True)
        return
    policy = mixed_precision(dtype)
    layers = repeated_layers(module)
    for layer in outermost(layers):  # a layer's nested lists (MoE experts) are recomputed with it
        checkpoint_activations(layer)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    for unit in fsdp_units(module):
        # Sum, not average, over ranks: the trainer divides by the global
        # token (or sequence) count itself, as the torch engine does.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def checkpoint_activations(layer: nn.Module) -> None:
    """Run ``layer``'s forward under non-reentrant activation checkpointing:
    a training forward keeps only the layer's inputs, and its backward runs
    the forward once more to rebuild the activations (about one extra
    forward per training forward). The forward is replaced, not the module wrapped, so
    parameter names (checkpoints, exported weights) stay the same; FSDP's
    hooks stay on the module's call, so the recompute, which calls the
    forward directly, runs on the parameters FSDP gathered for the backward."""
    layer.forward = types.MethodType(_checkpointed_forward, layer)


def _checkpointed_forward(layer: nn.Module, *args, **kwargs):
    forward = types.MethodType(type(layer).forward, layer)  # the class's own forward
    if not torch.is_grad_enabled():  # nothing to keep for a backward
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def reshard_all(module: nn.Module) -> None:
    """Free any gathered parameters (local, no communication): after a
    failed forward or backward left a unit unsharded."""
    for unit in fsdp_units(module):
        unit.reshard()


def gathered_parameters(module: nn.Module) -> list[str]:
    """The parameters whose full (unsharded) values are gathered right now:
    while gathered, FSDP registers a plain tensor in place of the DTensor shard."""
    return [name for name, param in module.named_parameters() if not isinstance(param, DTensor)]


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    if dtype not in DTYPES:
        raise ValueError(f"fsdp: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)


def repeated_layers(module: nn.Module) -> list[nn.Module]:
    return [layer for child in module.modules() if isinstance(child, nn.ModuleList) for layer in child]


def outermost(layers: list[nn.Module]) -> list[nn.Module]:
    """The layers not inside another of ``layers``."""
    nested = {id(inner) for layer in layers for inner in layer.modules() if inner is not layer}
    return [layer for layer in layers if id(layer) not in nested]


def fsdp_units(module: nn.Module) -> list[FSDPModule]:
    return [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
