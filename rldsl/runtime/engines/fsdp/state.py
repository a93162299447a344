"""The fsdp trainer's state outside a step: weight export and checkpoints
(offload: rldsl.runtime.engines.torch.offload).

Checkpoints are one file, ``fsdp.pt``, holding the full (unsharded) model
and optimizer state dicts under the parameters' names plus the version and
the optimizer-step count, gathered to and written by rank 0. A full file
loads at any rank count or shard size (and its ``model`` entry is a plain
state dict), at the price of gathering everything on rank 0's host memory;
sharded (``torch.distributed.checkpoint``) files would avoid that but tie a
checkpoint to its layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

CHECKPOINT_FILE = "fsdp.pt"


def full_state_buckets(module: torch.nn.Module, bucket_bytes: int):
    """The state dict with every shard gathered, as CPU copies in buckets of
    at most ``bucket_bytes`` (a larger tensor travels alone). Streams: a
    bucket is yielded before the next tensor is gathered (sizes come from the
    sharded tensors' global shapes), so beyond its shards a rank holds about
    one bucket. Every rank gathers (one collective per tensor); only the
    first rank keeps copies and yields, the others iterate along."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    keeps = dist.get_rank() == 0
    bucket, used = {}, 0
    for name, tensor in module.state_dict().items():
        size = tensor.numel() * tensor.element_size()  # a DTensor's numel is the full tensor's
        if used and used + size > bucket_bytes:
            if keeps:
                yield bucket
            bucket, used = {}, 0
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keeps:
            bucket[name] = full.detach().to("cpu", copy=True)
        del full  # the gathered copy goes before the next gather
        used += size
    if keeps and bucket:
        yield bucket


def save_full_checkpoint(directory, module, optimizer, counters: dict) -> None:
    from rldsl.runtime.atomic import save_torch_state

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # ranks > 0 get empty dicts
    model_state, optimizer_state = get_state_dict(module, optimizer, options=options)
    if dist.get_rank() == 0:
        save_torch_state(Path(directory) / CHECKPOINT_FILE, {"model": model_state, "optimizer": optimizer_state,
                                                             **counters})
    dist.barrier()  # returns on every rank once the file is complete


def load_full_checkpoint(directory, module, optimizer) -> dict:
    """Loads ``fsdp.pt`` into this rank's shards; returns its counters."""
    from rldsl.runtime.atomic import load_torch_state

    saved = load_torch_state(Path(directory) / CHECKPOINT_FILE)
    set_state_dict(module, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    return {key: value for key, value in saved.items() if key not in ("model", "optimizer")}
