"""Sharded construction for the fsdp engines: no rank ever holds the full model.

The module's parameters live on the meta device (no storage) when it is
``fully_shard``ed; ``to_empty`` then allocates only this rank's shards, and
each shard is filled with its own rows of every tensor:

- a Hugging Face model (``hf:<path>``) reads them from its safetensors
  files, ``get_slice(name)[start:stop]`` along dim 0, FSDP's shard dim, so a
  rank reads about ``1 / shard`` of the checkpoint;
- a module that already holds its weights (the builtin tiny model, built
  from its seed identically on every rank) is moved to meta first and each
  rank copies its rows from those tensors.

Buffers are not sharded: they keep the values they were built with (a Hugging
Face model's rotary ``inv_freq`` is computed in ``__init__`` and is in no
checkpoint, which is why ``parameters_on_meta`` leaves buffers real).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from rldsl.models.hf_checkpoint import HFTensors, open_hf_weights

@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered inside goes to the meta device as it is
    registered (before any initialiser writes it), while buffers stay real."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def meta_hf_model(source: str):
    """A Hugging Face ``CausalLM`` for ``hf:<path>`` built from its config with
    every parameter on meta: no weight is read here."""
    from rldsl.models.hf import HFCausalLM, HFTokenizer, _import_transformers

    path = source[len("hf:"):]
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{source}: no such local directory (models are never downloaded)")
    transformers = _import_transformers()
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    with parameters_on_meta():
        module = transformers.AutoModelForCausalLM.from_config(config)
    return HFCausalLM(module, HFTokenizer(tokenizer), source, config.to_dict())


def build_sharded(model, mesh, dtype: str, device: torch.device, frozen: bool = False) -> None:
    """Shard ``model.module`` in place on ``mesh`` with fp32 shards on
    ``device`` (``frozen``, a forward-only copy: shards in ``dtype``), filled
    from the checkpoint files of an ``hf:`` model whose parameters are on
    meta, else from the weights the module holds."""
    from rldsl.runtime.engines.fsdp.sharding import DTYPES, shard_module

    module = model.module
    params, buffers = detach_to_meta(module)
    # fp32 master shards for training whatever the compute or checkpoint dtype
    module.to(dtype=DTYPES[dtype] if frozen else torch.float32)
    shard_module(module, mesh, dtype, frozen=frozen)
    materialize(module, device, buffers)
    if params:
        fill_shards(module, HFTensors(params))
    elif model.source.startswith("hf:"):
        fill_shards(module, open_hf_weights(model.source[len("hf:"):]))
    else:
        raise ValueError(f"fsdp: {model.source} has its parameters on meta and no checkpoint files to read")


# -- which rows a rank holds ------------------------------------------------------


def local_rows(param: DTensor) -> tuple[int, int]:
    """The [start, stop) rows of dim 0 this rank's shard of ``param`` holds:
    FSDP splits dim 0 like ``torch.chunk`` over the mesh dim sharding it
    (the last ranks may get fewer rows, or none)."""
    rows = param.shape[0]
    start, stop = 0, rows
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"fsdp: expected parameters sharded on dim 0, got {placement}")
            ranks = param.device_mesh.size(mesh_dim)
            chunk = -(-rows // ranks)
            start = min(param.device_mesh.get_local_rank(mesh_dim) * chunk, rows)
            stop = min(start + chunk, rows)
    local = param.to_local().shape[0]
    if stop - start != local:
        raise RuntimeError(f"fsdp: computed rows [{start}, {stop}) but the local shard has {local}")
    return start, stop


# -- materialising and filling the shards -----------------------------------------


def detach_to_meta(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Move every parameter and buffer to meta; returns the real parameters
    and buffers it held, by name (kept alive by the returned references)."""
    params = {name: p.detach() for name, p in module.named_parameters() if not p.is_meta}
    buffers = {name: b for name, b in module.named_buffers() if not b.is_meta}
    module.to(device="meta")
    return params, buffers


def materialize(module: nn.Module, device: torch.device, buffers: dict[str, torch.Tensor]) -> None:
    """Allocate the (sharded) parameters on ``device``, uninitialised, and put
    the buffers' values back (``to_empty`` allocates those too)."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])


def fill_shards(module: nn.Module, source: HFTensors) -> None:
    """Copy each parameter's rows for this rank from ``source`` (tensors in
    memory, or a checkpoint read slice by slice) into its local shard. A
    tied parameter is read once, under whichever of its names the source has.
    With LoRA adapters (rldsl.models.lora) a base weight is read under the
    checkpoint's name (``q_proj.weight`` for ``q_proj.base_layer.weight``) and
    adapters the source lacks start as PEFT starts them (``lora_B`` zero:
    the adapted model equals the base)."""
    from rldsl.models.lora import init_adapter_shard, is_adapter

    available = set(source)
    with torch.no_grad():
        for names, param in _parameters_with_aliases(module):
            candidates = names + [n.replace(".base_layer.", ".") for n in names]
            name = next((n for n in candidates if n in available), None)
            if name is None and is_adapter(names[0]):
                init_adapter_shard(names[0], param.to_local())
                continue
            if name is None:
                raise KeyError(f"fsdp: no weights for parameter {names[0]!r} (aliases {names[1:]})")
            if source.shape_of(name) != tuple(param.shape):
                raise ValueError(f"fsdp: {name!r} has shape {source.shape_of(name)} in the checkpoint, "
                                 f"{tuple(param.shape)} in the model")
            start, stop = local_rows(param)
            param.to_local().copy_(source.read_slice(name, 0, start, stop))


def _parameters_with_aliases(module: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    by_identity: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_identity.setdefault(id(param), ([], param))[0].append(name)
    return list(by_identity.values())
