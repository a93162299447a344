"""Every finished run is exportable: a run that ends normally writes a final
checkpoint whatever `run { checkpoint_every }` is (final_checkpoint.py), so
`rldsl run pipelines/grpo_async.rlp --set run.steps=2` (its grid checkpoints
every 20 steps) then `rldsl export RUN_DIR --out DIR` works."""

from __future__ import annotations

import json

import pytest

from tests.runs import rldsl_here
from tests.shared_runs import TORCH_STEPS

pytest.importorskip("transformers")


@pytest.mark.ray
def test_a_two_step_run_of_a_twenty_step_grid_is_exported(torch_run, tmp_path):
    run_dir, out = torch_run.run_dir, tmp_path / "hf"
    plan = json.loads((run_dir / "plan.json").read_text())["pipelines"][0]["run"]
    assert TORCH_STEPS == plan["steps"] == 2 and plan["checkpoint_every"] == 20
    assert "final checkpoint: v000002" in torch_run.stderr
    assert sorted(d.name for d in (run_dir / "checkpoints").iterdir()) == ["v000002"]
    assert json.loads((run_dir / "checkpoints" / "v000002" / "progress.json").read_text())["steps_done"] == 2
    exported = rldsl_here("export", str(run_dir), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "exported v000002" in exported.stdout and (out / "config.json").is_file()
