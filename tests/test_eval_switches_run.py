"""`run { eval_at_start  eval_at_end }` and a `steps` cap beside `epochs`,
in a real `rldsl run`: which steps are evaluated, what summary.json and the
final table say, and which bound ends the run."""

from __future__ import annotations

import json

import pytest

from tests.runs import run_text

PIPELINE = """
pipeline switches
cluster { nodes = 1  gpus_per_node = 2 }
model policy { source = "builtin:tiny-lm" }
dataset prompts { source = "jsonl:add.jsonl"  eval_source = "builtin:arith"  eval_size = 4 }
stage generate rollout { model = policy  engine = torch  gpus = 1  samples_per_prompt = 2  max_new_tokens = 4 }
stage reward score { fn = "rldsl.rewards:exact_match" }
stage train actor { model = policy  engine = torch  gpus = 1  prompts_per_step = 2  micro_batch = 4 }
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> actor
staleness { max_lag = 1 }
run { steps = 3  epochs = 50  eval_every = 2  eval_at_start = false  eval_at_end = false  watchdog = 120s }
"""


@pytest.mark.ray
def test_a_run_without_start_and_end_evaluations_and_with_a_steps_cap(tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(6)]
    (tmp_path / "add.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run, run_dir, summary = run_text(tmp_path, PIPELINE)
    assert summary["exit"] == "finished" and summary["steps"] == 3  # 50 epochs of the prompts: far more steps
    assert "switches: the run takes 3 steps: steps = 3 ends it before 50 epochs of 36 training prompts" in run.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("eval")] == [2]  # neither step 0 nor the last step (3)
    assert [e["step"] for e in summary["evals"]] == [2]
    assert "eval_start" not in summary and "eval_end" not in summary
    assert "at step 2 (the only evaluation)" in run.stdout + run.stderr
