"""A mixture of experts' weights under checkpoint names, for pushes.

transformers 5 keeps each layer's experts fused in two parameters,
``...mlp.experts.gate_up_proj`` ``[E, 2F, H]`` (each expert's gate rows,
then its up rows) and ``...mlp.experts.down_proj`` ``[E, H, F]``, and
converts from the checkpoint names on load (its ``conversion_mapping``:
the experts merged along a new first dimension, gate and up concatenated).
Checkpoints, vLLM and the megatron engine name each expert
(``...mlp.experts.3.gate_proj.weight``), so that is what a push carries:
``checkpoint_tensors`` splits a fused parameter into views of its experts,
``runtime_view`` finds the slice of a fused parameter a received expert
tensor fills. Every other weight passes through unchanged.

Pure torch: no transformers import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch

_FUSED = re.compile(r"^(?P<experts>.*\.experts)\.(?P<part>gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_GATE_UP = ("gate_proj", "up_proj")  # a fused expert's rows: its gate's, then its up's


def _gate_up_part(gate_up: torch.Tensor, proj: str) -> torch.Tensor:
    """The rows of one expert's fused ``gate_up`` tensor ``[2F, H]`` that ``proj`` is (a view)."""
    width = gate_up.shape[0] // 2
    return gate_up[:width] if proj == "gate_proj" else gate_up[width:]


def _fused_name(expert: re.Match) -> str:
    """The fused parameter an expert's checkpoint tensor (an ``_EXPERT`` match) belongs to."""
    return f"{expert['experts']}.{'down_proj' if expert['proj'] == 'down_proj' else 'gate_up_proj'}"


def checkpoint_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)``, or a fused experts parameter as each expert's tensors (views)."""
    match = _FUSED.match(name)
    if match is None:
        yield name, tensor
        return
    experts = match["experts"]
    if match["part"] == "down_proj":
        for index, down in enumerate(tensor):
            yield f"{experts}.{index}.down_proj.weight", down
        return
    for index, gate_up in enumerate(tensor):
        for proj in _GATE_UP:
            yield f"{experts}.{index}.{proj}.weight", _gate_up_part(gate_up, proj)


def checkpoint_named(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        yield from checkpoint_tensors(name, tensor)


def runtime_view(name: str, params: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The part of a fused experts parameter that the checkpoint tensor
    ``name`` is (a view to copy into); None when ``name`` is no expert's or
    the model keeps its experts unfused."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    index, proj = int(match["index"]), match["proj"]
    fused = params.get(_fused_name(match))
    if fused is None or index >= len(fused):
        return None
    return fused[index] if proj == "down_proj" else _gate_up_part(fused[index], proj)


def fused_state(state: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """``state`` with checkpoint-named experts stacked into the fused
    parameters among ``names`` (a transformers model's), as its load would."""
    wanted = set(names)
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, tensor in state.items():
        match = _EXPERT.match(name)
        fused = _fused_name(match) if match else None
        if fused is None or fused not in wanted or name in wanted:
            out[name] = tensor
            continue
        parts.setdefault(fused, {}).setdefault(int(match["index"]), {})[match["proj"]] = tensor
    for fused, experts in parts.items():
        order = [experts[index] for index in range(len(experts))]
        out[fused] = torch.stack([e["down_proj"] if fused.endswith("down_proj") else
                                  torch.cat([e[proj] for proj in _GATE_UP]) for e in order])
    return out
