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
"""

from __future__ import annotations

from pathlib import Path

from rldsl.runtime.atomic import write_json_atomically

__all__ = ["PROGRESS_FILE", "TRAINER_DIR", "TRAINER_MARKER", "checkpoint_dir", "compress_indices",
           "expand_indices", "latest_complete", "write_json_atomically"]

TRAINER_DIR = "trainer"
TRAINER_MARKER = "trainer.json"
PROGRESS_FILE = "progress.json"


def checkpoint_dir(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"v{version:06d}"


def latest_complete(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    complete = [d for d in root.iterdir() if (d / TRAINER_MARKER).exists() and (d / PROGRESS_FILE).exists()]
    return max(complete, key=lambda d: d.name) if complete else None


def compress_indices(indices: set[int]) -> dict:
    """{'below': w, 'above': [...]}: every index < w is in the set, plus a few above."""
    below = 0
    while below in indices:
        below += 1
    return {"below": below, "above": sorted(i for i in indices if i > below)}


def expand_indices(compressed: dict) -> tuple[int, set[int]]:
    return compressed["below"], set(compressed["above"])
