"""``FsdpLogprob``: log-probabilities for an fsdp stage.

``shard`` is the number of ranks one copy of the model is split over:

- ``1`` (a logprob stage's default): each rank holds the whole model in the
  engine's dtype (on its GPU when it has one) and serves batches alone,
  like the torch engine's ``TorchLogprob``;
- ``0`` (all the stage's ranks) or a divisor ``s`` of them: the model is
  built sharded (``loading.build_sharded``, frozen: the shards stay in the
  compute dtype, about ``1 / s`` of the parameters per rank at rest) and
  every forward all-gathers one layer at a time. The ``s`` ranks of a shard
  group form one replica: each call reaches all of them with the same rows,
  each rank scores a contiguous share, the ranks run the same number of
  forwards (padded with one-token forwards, as the trainer's lockstep) so
  the per-layer all-gathers line up, and every rank returns the whole
  batch's logprobs (an all-gather of the shares).

A policy logprob stage receives the trainer's weight buckets (full tensors,
the same names); a sharded rank copies only its rows of each. With
``offload`` the whole or sharded copy stays in host memory between calls
(``module.to``, which FSDP follows; torch/offload.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rldsl.runtime.engines.fsdp.loading import build_sharded, local_rows
from rldsl.runtime.engines.fsdp.sharding import DTYPES, build_mesh, training_device
from rldsl.runtime.engines.torch.common import packed_response_logprobs, response_logprobs
from rldsl.runtime.engines.torch.logprob import TorchLogprob
from rldsl.runtime.engines.torch.offload import on_device_for_call
from rldsl.runtime.engines.torch.packing import forward_rows, scatter_rows, take_rows, trim_padding
from rldsl.runtime.protocols import FIELD_RESPONSE_IDS, FIELD_RESPONSE_MASK, Batch


class FsdpLogprob(TorchLogprob):
    def __init__(self, model, dtype: str = "fp32", shard: int = 1, process_group=None,
                 rows_per_forward: int | None = None, tokens_per_forward: int = 0, offload: bool = False,
                 temperature: float = 1.0):
        if dtype not in DTYPES:
            raise ValueError(f"fsdp: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if shard < 0:
            raise ValueError(f"fsdp: shard must be 0 (all ranks) or a rank count, got {shard}")
        device = training_device()
        self.mesh = None
        if _copy_ranks(shard, process_group) > 1:
            self.mesh = build_mesh(process_group, shard, device.type)
            build_sharded(model, self.mesh, dtype, device, frozen=True)
        elif any(param.is_meta for param in model.module.parameters()):
            raise ValueError(f"fsdp: {model.source} was built without weights for sharding, but this logprob "
                             f"rank holds a whole copy (shard = {shard} outside a process group of several ranks)")
        else:
            model.module.to(device=device, dtype=DTYPES[dtype])
        super().__init__(model, rows_per_forward=rows_per_forward, tokens_per_forward=tokens_per_forward,
                         offload=offload, temperature=temperature)

    @property
    def shard_group(self):
        """The ranks holding one copy between them (None: unsharded)."""
        return None if self.mesh is None else self.mesh.get_group(self.mesh.ndim - 1)

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        if self.mesh is None:
            return super().logprobs(batch)
        self.require_consistent_weights()
        with on_device_for_call(self):
            return self._sharded_logprobs(batch)

    def _sharded_logprobs(self, batch: Batch) -> torch.Tensor:
        """This rank's share of the rows, scored in lockstep with its group."""
        group = self.shard_group
        rows, width = batch[FIELD_RESPONSE_IDS].shape
        if rows == 0:  # every rank of the group has the same batch: none runs a forward
            return torch.zeros(0, 0)
        start, stop = _share(rows, dist.get_rank(group), dist.get_world_size(group))
        mine = take_rows(batch, list(range(start, stop)))
        forwards = forward_rows(mine, self.rows_per_forward, self.tokens_per_forward) if stop > start else []
        results = []
        for index in range(self._agreed_count(len(forwards), group)):
            if index < len(forwards):
                results.append((forwards[index], self._forward(take_rows(mine, forwards[index]))))
            else:
                self._empty_forward()
        return self._gathered(scatter_rows(iter(results), stop - start, width), rows, group)

    def update_weights(self, bucket, version: int, last: bool) -> None:
        """Full tensors by name; a sharded parameter takes only its own rows."""
        if self.mesh is None:
            return super().update_weights(bucket, version, last)
        targets = self.model.module.state_dict()
        sharded = {name for name in bucket if isinstance(targets.get(name), DTensor)}
        super().update_weights({n: t for n, t in bucket.items() if n not in sharded}, version, last)
        with torch.no_grad():
            for name in sharded:
                target, tensor = targets[name], bucket[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
                start, stop = local_rows(target)
                target.to_local().copy_(tensor[start:stop])

    def weight_snapshot(self) -> list[dict[str, torch.Tensor]]:
        """The full weights (gathered: every rank of the group calls it)."""
        if self.mesh is None:
            return super().weight_snapshot()
        with on_device_for_call(self):  # the gathers run on the group's device
            weights = self.model.module.state_dict()
            return [{name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)
                     for name, t in weights.items()}]

    # -- helpers ---------------------------------------------------------------

    def _forward(self, rows: Batch) -> torch.Tensor:
        """One forward of these rows, always (a packed forward of rows with no
        response token would otherwise run none)."""
        if not self.tokens_per_forward:
            return response_logprobs(self.model, rows, self.temperature)
        if int(rows[FIELD_RESPONSE_MASK].sum()) == 0:
            self._empty_forward()
            return torch.zeros(rows[FIELD_RESPONSE_MASK].shape)
        return packed_response_logprobs(self.model, trim_padding(rows), self.temperature)

    def _empty_forward(self) -> None:
        """A one-token forward: the same all-gathers as a real one."""
        token = torch.zeros((1, 1), dtype=torch.long, device=self.model.device)
        self.model.forward(token, None, token, use_cache=False)

    def _agreed_count(self, count: int, group) -> int:
        """The most forwards any rank of the group runs (all-reduce MAX)."""
        agreed = torch.tensor([count], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        return int(agreed)

    def _gathered(self, values: torch.Tensor, rows: int, group) -> torch.Tensor:
        """Every rank's share, in rank order: the whole batch on every rank."""
        size = dist.get_world_size(group)
        chunk = -(-rows // size)
        padded = torch.zeros(chunk, values.shape[1], device=self._collective_device())
        padded[: len(values)] = values
        shares = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(shares, padded, group=group)
        return torch.cat(shares)[:rows].cpu()

    def _collective_device(self) -> torch.device:
        return self.model.device  # NCCL moves GPU tensors, gloo CPU ones


def _copy_ranks(shard: int, process_group) -> int:
    """How many ranks one copy is split over: ``shard``, or every rank of
    the group (0); 1 without a process group."""
    if shard == 1 or not dist.is_initialized():
        return 1
    return dist.get_world_size(process_group) if shard == 0 else shard


def _share(rows: int, rank: int, ranks: int) -> tuple[int, int]:
    """The [start, stop) rows a rank scores: contiguous chunks of ceil(rows / ranks)."""
    chunk = -(-rows // ranks)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)
