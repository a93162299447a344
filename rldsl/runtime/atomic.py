"""Files written whole or not at all, for every layer that saves state
(engines' checkpoints, the lowering's markers and progress records)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomically(path: Path, payload: dict, indent: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, sort_keys=True, indent=indent) + "\n")
    os.replace(tmp, path)


def save_torch_state(path: Path, state: dict) -> None:
    """``torch.save`` that never leaves a half-written file behind."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_torch_state(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)
