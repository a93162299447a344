"""A megatron trainer checkpoint back to full Hugging Face tensors, offline.

``state.save_checkpoint`` leaves one file per rank, each holding that rank's
tensor- and pipeline-parallel shard of the model under its stage's local
layer numbers. Here, without megatron-core or a process group:

- the files of the first data-parallel replica are read (the others hold
  the same weights), each memory-mapped so the optimizer state in it is
  never read;
- every pipeline stage's layers are renumbered globally: a stage's first
  layer comes after every layer of the stages before it;
- the tensor-parallel shards of each tensor are merged
  (``hf_weights.merge_tensor_parallel``: vocabulary rows, q/k/v groups,
  ``[gate_r; up_r]`` pairs, row-parallel columns);
- a mixture of experts' experts come from the ranks that hold them: each
  expert-parallel rank's local experts get their global ids, an expert's
  shards are merged over its expert-tensor-parallel ranks (each file says
  its place, ``experts``; files written before that hold no expert
  parallelism other than replica 0's tensor-parallel one);
- the full Megatron tensors are converted to Hugging Face names and layouts
  (``hf_weights.megatron_to_hf``: q/k/v and gate/up un-fused).

Ranks are in Megatron's order: tensor-parallel rank fastest, then data
parallel, pipeline parallel slowest.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from rldsl.runtime.engines.megatron.hf_weights import (
    LlamaShape,
    is_expert_weight,
    megatron_to_hf,
    merge_tensor_parallel,
    with_expert_offset,
    with_layer_offset,
)
from rldsl.runtime.engines.megatron.state import checkpoint_file

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


class MegatronCheckpointError(ValueError):
    """The rank files are missing, unreadable or do not fit together."""


def read_replica_shards(directory) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """(pp rank, tp rank) -> that rank's model state, for data-parallel replica 0."""
    layout = _load(checkpoint_file(directory, 0))["layout"]
    tp, dp = layout["tp"], layout["dp"]
    return {(pp_rank, tp_rank): _rank_state(directory, tp_rank + tp * dp * pp_rank, layout)["model"]
            for pp_rank in range(layout["pp"]) for tp_rank in range(tp)}  # data-parallel rank 0


def read_expert_shards(directory) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """(pp rank, ep rank, etp rank) -> the expert weights of a rank holding
    that place ({} when replica 0's tensor-parallel ranks hold every expert
    as they hold the dense weights)."""
    first = _load(checkpoint_file(directory, 0))
    layout, experts = first["layout"], first.get("experts")
    if not experts or (experts["ep"], experts["etp"]) == (1, layout["tp"]):
        return {}
    per_stage = layout["world_size"] // layout["pp"]
    shards = {}
    for rank in range(layout["world_size"]):
        state = _rank_state(directory, rank, layout)
        place = (rank // per_stage, state["experts"]["ep_rank"], state["experts"]["etp_rank"])
        shards.setdefault(place, {n: t for n, t in _weights(state["model"]).items() if is_expert_weight(n)})
    return shards


def _rank_state(directory, rank: int, layout: dict) -> dict:
    state = _load(checkpoint_file(directory, rank))
    if state["layout"] != {**layout, "rank": rank}:
        raise MegatronCheckpointError(f"{checkpoint_file(directory, rank)} has layout {state['layout']}, "
                                      f"rank 0 has {layout}: the files are from different runs")
    return state


def _load(path: Path) -> dict:
    if not path.exists():
        raise MegatronCheckpointError(f"megatron checkpoint file {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - a damaged file, whatever torch raises for it
        raise MegatronCheckpointError(f"cannot read {path}: {err}") from err


def merge_shards(shards: dict[tuple[int, int], dict[str, torch.Tensor]],
                 experts: dict[tuple[int, int, int], dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """Full Megatron tensors under global layer numbers, from every stage's
    tensor-parallel shards (and ``experts``' shards, ``read_expert_shards``)."""
    pp = 1 + max(pp_rank for pp_rank, _ in shards)
    tp = 1 + max(tp_rank for _, tp_rank in shards)
    merged, offset = {}, 0
    for pp_rank in range(pp):
        stage = [_weights(shards[(pp_rank, tp_rank)]) for tp_rank in range(tp)]
        for name in stage[0]:
            if not (experts and is_expert_weight(name)):
                merged[with_layer_offset(name, offset)] = merge_tensor_parallel(name, [s[name] for s in stage])
        if experts:
            merged.update({with_layer_offset(name, offset): tensor
                           for name, tensor in _merge_experts(experts, pp_rank).items()})
        offset += _layer_count(stage[0])
    return merged


def _merge_experts(experts: dict[tuple[int, int, int], dict[str, torch.Tensor]], pp_rank: int) -> dict:
    """A stage's experts under global expert ids, each merged over its expert-tensor-parallel shards."""
    places = sorted(place[1:] for place in experts if place[0] == pp_rank)
    ep, etp = 1 + max(ep_rank for ep_rank, _ in places), 1 + max(etp_rank for _, etp_rank in places)
    merged = {}
    for ep_rank in range(ep):
        shards = [experts[(pp_rank, ep_rank, etp_rank)] for etp_rank in range(etp)]
        per_rank = len(_local_experts(shards[0]))
        for name in shards[0]:
            merged[with_expert_offset(name, ep_rank * per_rank)] = merge_tensor_parallel(name, [s[name] for s in shards])
    return merged


def _local_experts(state: dict) -> set[str]:
    return {match.group(1) for match in map(_LOCAL_EXPERT.search, state) if match}


def _weights(state: dict) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in state.items()
            if tensor is not None and not name.endswith("_extra_state")}


def _layer_count(state: dict) -> int:
    return len({match.group(1) for match in map(_LOCAL_LAYER.match, state) if match})


def uses_fused_norm_names(megatron: dict[str, torch.Tensor]) -> bool:
    """Transformer Engine layers keep the norms inside the fused linears."""
    return any(name.endswith("linear_qkv.layer_norm_weight") for name in megatron)


def checkpoint_to_hf(directory, shape: LlamaShape) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of a megatron trainer checkpoint (no ``lm_head`` when tied)."""
    megatron = merge_shards(read_replica_shards(directory), read_expert_shards(directory))
    if shape.tied_embeddings:
        megatron.pop("output_layer.weight", None)  # the last stage's copy of the embedding
    try:
        return megatron_to_hf(megatron, shape, uses_fused_norm_names(megatron))
    except (KeyError, RuntimeError) as err:
        raise MegatronCheckpointError(f"the checkpoint does not fit the model's config.json: {err}") from err
