"""`run { keep_checkpoints = N }`: only the N newest complete checkpoints
stay, a half-written newer one is never touched, and a run pruned this way
still resumes from its newest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.runtime.ray_lowering.checkpoint import (
    PROGRESS_FILE,
    TRAINER_MARKER,
    checkpoint_dir,
    latest_complete,
    prune_checkpoints,
)

from tests.runs import LEAN_SIM_ASYNC, rldsl_here
from tests.shared_runs import SIM_OVERRIDES, copy_run

ROOT = Path(__file__).resolve().parent.parent


def write_checkpoint(run_dir: Path, version: int, *, trainer: bool = True, progress: bool = True) -> Path:
    directory = checkpoint_dir(run_dir, version)
    (directory / "trainer").mkdir(parents=True)
    if trainer:
        (directory / TRAINER_MARKER).write_text("{}")
    if progress:
        (directory / PROGRESS_FILE).write_text("{}")
    return directory


def names(run_dir: Path) -> list[str]:
    return sorted(d.name for d in (run_dir / "checkpoints").iterdir())


def test_the_newest_complete_ones_stay_and_a_newer_half_written_one_is_left_alone(tmp_path):
    for version in (2, 4, 6, 8):
        write_checkpoint(tmp_path, version)
    write_checkpoint(tmp_path, 3, progress=False)  # abandoned half of an older checkpoint
    write_checkpoint(tmp_path, 10, trainer=False)  # the trainer's half still being written
    assert prune_checkpoints(tmp_path, 2) == ["v000002", "v000003", "v000004"]
    assert names(tmp_path) == ["v000006", "v000008", "v000010"]
    assert latest_complete(tmp_path).name == "v000008"
    assert prune_checkpoints(tmp_path, 2) == []  # idempotent: the other writer prunes too


def test_zero_keeps_everything(tmp_path):
    for version in (1, 2, 3):
        write_checkpoint(tmp_path, version)
    assert prune_checkpoints(tmp_path, 0) == [] and len(names(tmp_path)) == 3


def test_the_setting_reaches_the_plan_and_defaults_to_keeping_all():
    text = (ROOT / "pipelines" / "sim_async.rlp").read_text()
    assert compile_source(text, "x.rlp").plan.pipelines[0].run.keep_checkpoints == 0
    kept = compile_source(text.replace("run {", "run {\n  keep_checkpoints = 3"), "x.rlp")
    assert kept.ok, kept.diagnostics
    assert kept.plan.pipelines[0].run.keep_checkpoints == 3


@pytest.mark.ray
def test_a_run_keeps_its_last_two_checkpoints_and_resumes_from_the_newest(sim_run_with_overrides, tmp_path):
    assert "run.keep_checkpoints=2" in SIM_OVERRIDES and "run.steps=5" in SIM_OVERRIDES
    run_dir = copy_run(sim_run_with_overrides, tmp_path / "run")
    assert names(run_dir) == ["v000004", "v000005"]
    assert json.loads((run_dir / "checkpoints" / "v000005" / PROGRESS_FILE).read_text())["steps_done"] == 5
    longer = rldsl_here("run", "--resume", str(run_dir), "--steps", "7")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert names(run_dir) == ["v000006", "v000007"]


@pytest.mark.ray
def test_a_resume_keeps_the_steps_a_run_in_epochs_was_started_with(tmp_path):
    """A file sized in epochs (2 steps here), started with `--steps 4`: a
    plain `--resume` keeps the 4 instead of recomputing 2 and going negative."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(3)]
    (tmp_path / "add.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = (ROOT / "pipelines" / "sim_async.rlp").read_text()
    text = text.replace('dataset prompts { source = "builtin:arith"  eval_size = 16 }',
                        'dataset prompts { source = "jsonl:add.jsonl"  eval_size = 2 }')
    pipeline = tmp_path / "epochs.rlp"
    pipeline.write_text(text.replace("run { steps = 5", "run { epochs = 1  checkpoint_every = 1"))
    run_dir = tmp_path / "run"
    first = rldsl_here("run", str(pipeline), *LEAN_SIM_ASYNC, "--steps", "4", "--run-dir", str(run_dir))
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = rldsl_here("run", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "nothing to do: 4 of 4 steps are done" in resumed.stderr
    shorter = rldsl_here("run", "--resume", str(run_dir), "--steps", "3")
    assert shorter.returncode == 0 and "Traceback" not in shorter.stderr, shorter.stderr[-3000:]
    assert "nothing to do: 4 of 3 steps are done (to train more" in shorter.stderr
