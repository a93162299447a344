"""pipelines/judge_cpu.rlp end to end on the CPU: the builtin tiny model
judges on a Ray logical GPU of its own, beside an exact-match function, and
each step logs both components."""

import json

import pytest

from tests.runs import rldsl_here


@pytest.mark.ray
def test_a_pipeline_with_a_reward_model_stage_trains_and_logs_its_component(tmp_path):
    run_dir = tmp_path / "run"
    run = rldsl_here("run", "pipelines/judge_cpu.rlp", "--run-dir", str(run_dir), "--set", "run.steps=3")
    assert run.returncode == 0, run.stderr[-3000:]
    placement = json.loads((run_dir / "plan.json").read_text())
    judge = next(s for s in placement["pipelines"][0]["stages"] if s["name"] == "judge")
    assert judge["engine"]["name"] == "torch" and judge["ranks"][0]["gpus"] == [2]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward_components" in s]
    assert len(steps) == 3
    for step in steps:
        parts = step["reward_components"]
        assert set(parts) == {"correct", "judge"} and 0.0 <= parts["judge"] <= 1.0
        assert step["reward_mean"] == pytest.approx(parts["correct"] + 0.1 * parts["judge"])
    ledger = json.loads((run_dir / "summary.json").read_text())["ledger"]
    assert ledger["trained"] > 0 and ledger["open"] == 0
