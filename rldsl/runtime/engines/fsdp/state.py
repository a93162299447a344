"""The fsdp trainer's state outside a step: weight export and checkpoints
(offload: rldsl.runtime.engines.torch.offload).

Checkpoints are sharded (``torch.distributed.checkpoint``): under
``directory/fsdp/`` each rank writes its own shards of the model and of the
optimizer state, nothing is gathered, and rank 0 adds the metadata and
``fsdp.json`` (the version and the optimizer-step count). A rank's host
memory holds its shards and one write buffer, so a checkpoint's time and
memory shrink with the rank count instead of growing with the model. The
files load at any rank count or ``shard`` size (each rank reads the pieces
its own shards cover), and ``read_model_state`` reads the model alone,
without a process group (`rldsl export`). A checkpoint written before, one
gathered file ``fsdp.pt``, still loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from rldsl.models.hf_layout import checkpoint_tensors

CHECKPOINT_DIR = "fsdp"  # the shards and their metadata
COUNTERS_FILE = "fsdp.json"
CHECKPOINT_FILE = "fsdp.pt"  # the gathered single file of earlier checkpoints


def full_state_buckets(module: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None,
                       only=None, on_host: bool = True):
    """The state dict with every shard gathered, as CPU copies in buckets of
    at most ``bucket_bytes`` (a larger tensor travels alone); floating
    tensors in ``dtype`` when given (the compute dtype: what the trainer's
    forwards use, half the bytes of the fp32 masters in bf16). Streams: a
    bucket is yielded before the next tensor is gathered (sizes come from the
    sharded tensors' global shapes), so beyond its shards a rank holds about
    one bucket. Every rank gathers (one collective per tensor); only the
    first rank keeps copies and yields, the others iterate along. ``only``:
    a test of the names to push (LoRA: the adapters). Without ``on_host``
    the gathered tensors stay on their device (a rank-to-rank push packs
    them there: no host round trip on a GPU); a tensor that needed no
    gather is then the parameter itself, valid until the next optimizer
    step."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    keeps = dist.get_rank() == 0
    bucket, used = {}, 0
    for name, tensor in module.state_dict().items():
        if only is not None and not only(name):
            continue
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        size = tensor.numel() * cast.itemsize  # a DTensor's numel is the full tensor's
        if used and used + size > bucket_bytes:
            if keeps:
                yield bucket
            bucket, used = {}, 0
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keeps:  # a mixture of experts' fused parameters as each expert's tensors, under checkpoint names
            bucket.update((part, value.detach().to("cpu", dtype=cast, copy=True) if on_host
                           else value.detach().to(dtype=cast)) for part, value in checkpoint_tensors(name, full))
        del full  # the gathered copy goes before the next gather
        used += size
    if keeps and bucket:
        yield bucket


def _options(module) -> StateDictOptions:
    """With LoRA adapters only they (and their optimizer state) are checkpointed: the base is frozen."""
    from rldsl.models.lora import has_adapters

    adapters = has_adapters(module)
    return StateDictOptions(ignore_frozen_params=adapters, strict=not adapters)


def save_checkpoint(directory, module, optimizer, counters: dict) -> None:
    """Each rank writes its shards of the model and optimizer state (with
    LoRA, of the adapters); rank 0 the metadata and the counters. A
    collective: returns on every rank once the checkpoint is complete."""
    model_state, optimizer_state = get_state_dict(module, optimizer, options=_options(module))  # this rank's shards
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=Path(directory) / CHECKPOINT_DIR)
    if dist.get_rank() == 0:
        from rldsl.runtime.atomic import write_json_atomically

        write_json_atomically(Path(directory) / COUNTERS_FILE, counters)
    dist.barrier()


def load_checkpoint(directory, module, optimizer) -> dict:
    """This rank's shards from ``directory`` (sharded, or an earlier gathered
    ``fsdp.pt``); returns the counters."""
    directory = Path(directory)
    if not (directory / CHECKPOINT_DIR).is_dir() and (directory / CHECKPOINT_FILE).is_file():
        return _load_full_checkpoint(directory, module, optimizer)
    options = _options(module)
    model_state, optimizer_state = get_state_dict(module, optimizer, options=options)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory / CHECKPOINT_DIR)  # in place, into this rank's shards
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)
    return json.loads((directory / COUNTERS_FILE).read_text())


def read_model_state(directory) -> dict[str, torch.Tensor]:
    """The whole model, unsharded, from a checkpoint ``directory``, in this
    process alone (no process group): the metadata says every tensor's
    shape and dtype, and each is read whole. The optimizer state is not read."""
    directory = Path(directory)
    if not (directory / CHECKPOINT_DIR).is_dir():
        from rldsl.runtime.atomic import load_torch_state

        return dict(load_torch_state(directory / CHECKPOINT_FILE)["model"])
    metadata = dcp.FileSystemReader(directory / CHECKPOINT_DIR).read_metadata()
    prefix = "model."
    state = {key[len(prefix):]: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    dcp.load({"model": state}, checkpoint_id=directory / CHECKPOINT_DIR, no_dist=True)
    return state


def _load_full_checkpoint(directory: Path, module, optimizer) -> dict:
    from rldsl.runtime.atomic import load_torch_state

    saved = load_torch_state(directory / CHECKPOINT_FILE)
    set_state_dict(module, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    return {key: value for key, value in saved.items() if key not in ("model", "optimizer")}
