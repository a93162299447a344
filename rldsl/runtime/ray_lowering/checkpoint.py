"""Checkpoints: where they live and what makes one complete.

    RUN_DIR/checkpoints/v000020/trainer/        the trainer engine's own files
    RUN_DIR/checkpoints/v000020/trainer.json    written last: version, engine
    RUN_DIR/checkpoints/v000020/progress.json   steps done, prompts trained

The trainer engine saves its state in its own format (the torch engine one
file from rank 0, megatron one file per rank); every rank takes part, and
rank 0 writes ``trainer.json`` once all of them are done. The controller
writes ``progress.json`` when it records the same version. A checkpoint is
complete when both JSON files exist. Resuming reloads the trainer, pushes its weights
to the generators and skips every prompt already trained, so no sample is
trained twice; groups generated but not yet trained are generated again.

With ``run { keep_checkpoints = N }`` only the N newest complete checkpoints
stay: both writers prune once their half is written, and nothing newer than
the newest complete checkpoint is touched (it may be half written).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rldsl.runtime.atomic import write_json_atomically

__all__ = ["PROGRESS_FILE", "TRAINER_DIR", "TRAINER_MARKER", "checkpoint_dir", "compress_indices",
           "complete_checkpoints", "expand_indices", "latest_complete", "prune_checkpoints", "write_json_atomically"]

TRAINER_DIR = "trainer"
TRAINER_MARKER = "trainer.json"
PROGRESS_FILE = "progress.json"


def checkpoint_dir(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"v{version:06d}"


def latest_complete(run_dir: Path) -> Path | None:
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (``vNNNNNN`` with both markers), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(d for d in root.glob("v[0-9]*")
                  if d.name[1:].isdigit() and (d / TRAINER_MARKER).is_file() and (d / PROGRESS_FILE).is_file())


def prune_checkpoints(run_dir: Path, keep: int) -> list[str]:
    """Remove every checkpoint older than the ``keep`` newest complete ones
    (0: keep all); returns the names removed. Directories newer than the
    newest complete checkpoint are left alone: one may be being written."""
    complete = complete_checkpoints(run_dir)
    if not keep or len(complete) <= keep:
        return []
    oldest_kept = complete[-keep].name
    removed = sorted(d for d in (Path(run_dir) / "checkpoints").iterdir() if d.is_dir() and d.name < oldest_kept)
    for directory in removed:
        shutil.rmtree(directory, ignore_errors=True)  # the other writer may prune the same one at once
    return [d.name for d in removed]


def compress_indices(indices: set[int]) -> dict:
    """{'below': w, 'above': [...]}: every index < w is in the set, plus a few above."""
    below = 0
    while below in indices:
        below += 1
    return {"below": below, "above": sorted(i for i in indices if i > below)}


def expand_indices(compressed: dict) -> tuple[int, set[int]]:
    return compressed["below"], set(compressed["above"])
