"""Runs that several tests read, each made once per session (conftest.py
exposes them as fixtures). A run costs most of its time starting its actors;
the properties asserted on it stay in the test files they belong to.

The run directories are read-only for the tests: one that resumes a run
copies it first (``copy_run``)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.runs import LEAN_SIM_ASYNC_SETTINGS, rldsl_here

# the lean shape: none of the tests reading this run is about dp 2
SIM_OVERRIDES = ["run.steps=5", "run.checkpoint_every=1", "run.keep_checkpoints=2", "run.log=[mlflow]",
                 *LEAN_SIM_ASYNC_SETTINGS]
TORCH_STEPS = 2
RLOO_STEPS = 5
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class SharedRun:
    run_dir: Path
    stdout: str
    stderr: str

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())


def _run(run_dir: Path, *args: str) -> SharedRun:
    result = rldsl_here("run", *args, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return SharedRun(run_dir, result.stdout, result.stderr)


@pytest.fixture(scope="session")
def sim_run_with_overrides(tmp_path_factory) -> SharedRun:
    """`pipelines/sim_async.rlp` with `--set` overrides (test_overrides.py):
    5 steps, a checkpoint after each of which the 2 newest stay
    (test_checkpoint_retention.py), metrics to MLflow only (test_loggers.py)."""
    args = [arg for override in SIM_OVERRIDES for arg in ("--set", override)]
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)  # MLflow's default store: in the run directory
        return _run(tmp_path_factory.mktemp("sim") / "run", "pipelines/sim_async.rlp", *args)


@pytest.fixture(scope="session")
def torch_run(tmp_path_factory) -> SharedRun:
    """`pipelines/grpo_async.rlp` for TORCH_STEPS steps of its 20-step checkpoint grid: trains and
    evaluates (test_run_e2e.py), writes its final checkpoint all the same (test_final_checkpoint.py),
    exports it (test_export.py)."""
    return _run(tmp_path_factory.mktemp("torch") / "run", "pipelines/grpo_async.rlp", "--set",
                f"run.steps={TORCH_STEPS}")


@pytest.fixture(scope="session")
def rloo_tis_run(tmp_path_factory) -> SharedRun:
    """`pipelines/rloo_minibatch.rlp` (two optimizer steps per rollout batch,
    RLOO, packing, warmup) with the truncated importance-sampling correction,
    RLOO_STEPS steps: learns (test_run_e2e.py) and reports the generator /
    trainer mismatch (test_rollout_correction.py)."""
    text = (ROOT / "pipelines" / "rloo_minibatch.rlp").read_text()
    text = text.replace("agg = seq_mean_token_mean)", "agg = seq_mean_token_mean, correction = tis)")
    assert "correction = tis" in text
    directory = tmp_path_factory.mktemp("rloo")
    (directory / "rloo_tis.rlp").write_text(text.replace("checkpoint_every = 20", "checkpoint_every = 0"))
    return _run(directory / "run", str(directory / "rloo_tis.rlp"), "--steps", str(RLOO_STEPS))


def copy_run(run: SharedRun, to: Path) -> Path:
    """A copy of a shared run's directory, for a test that changes it (a resume)."""
    shutil.copytree(run.run_dir, to)
    return to
