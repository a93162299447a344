"""`rldsl run` end to end, as a user runs it: a real local Ray, the real
TransferQueue data plane, one actor per planned rank."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def run(args, tmp_path, timeout=400):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "rldsl", "run", *args, "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    return proc, tmp_path / "run"


def test_sim_pipeline_runs_and_the_ledger_balances(tmp_path):
    proc, run_dir = run(["pipelines/sim_async.rlp", "--steps", "4"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["steps"] == 4
    assert ledger["generated"] == ledger["trained"] + sum(ledger["dropped"].values())
    assert summary["max_lag"] <= 1
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "step" in s and not s.get("eval")] == [1, 2, 3, 4]
    assert json.loads((run_dir / "plan.json").read_text())["pipelines"][0]["name"] == "sim_async"


def test_torch_pipeline_trains_and_evaluates(tmp_path):
    proc, run_dir = run(["pipelines/grpo_async.rlp", "--steps", "3"], tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["version"] == 3
    assert 0.0 <= summary["eval_start"] <= 1.0 and 0.0 <= summary["eval_end"] <= 1.0
    assert summary["ledger"]["trained"] == 3 * 16 * 8
    assert "held-out accuracy" in proc.stderr


def test_a_saved_plan_runs_exactly(tmp_path):
    plan = tmp_path / "plan.json"
    subprocess.run([sys.executable, "-m", "rldsl", "plan", "pipelines/sim_async.rlp", "--out", str(plan)],
                   check=True, cwd=ROOT, capture_output=True)
    proc, run_dir = run(["--plan", str(plan), "--steps", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "plan.json").read_text().strip() == plan.read_text().strip()
