"""`rldsl run` of a file with two pipelines: one Ray, one data plane, one set
of placement groups, a controller each, followed together."""

import json
import re
from pathlib import Path

import pytest

from tests.runs import rldsl_here

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray]

# Two sim pipelines sharing logical GPU 1 (declared by `share`); `slow` stalls (its trainer
# outlasts the watchdog) when asked.
PIPELINES = """
cluster {{ nodes = 1  gpus_per_node = 2 }}
pipeline fast {{
  model policy {{ source = "builtin:tiny-lm" }}
  dataset prompts {{ source = "builtin:arith" }}
  stage generate rollout {{ model = policy  engine = sim(latency = 10ms)  gpus = [0]  samples_per_prompt = 4 }}
  stage reward score {{ fn = "rldsl.rewards:exact_match" }}
  stage train actor {{ model = policy  engine = sim(latency = 10ms)  gpus = [1]  prompts_per_step = 2 }}
  stage sync weights {{ from = actor  to = rollout }}
  flow prompts -> rollout -> score -> actor
  staleness {{ max_lag = 1 }}
  run {{ steps = 4 }}
}}
pipeline slow {{
  model policy {{ source = "builtin:tiny-lm" }}
  dataset prompts {{ source = "builtin:reverse" }}
  stage generate rollout {{ model = policy  engine = sim(latency = 20ms)  gpus = [1]  samples_per_prompt = 2 }}
  stage reward score {{ fn = "rldsl.rewards:char_match" }}
  stage train actor {{ model = policy  engine = sim(latency = {train_latency})  gpus = [1]  prompts_per_step = 2 }}
  stage sync weights {{ from = actor  to = rollout }}
  flow prompts -> rollout -> score -> actor
  staleness {{ max_lag = 0 }}
  placement {{ share = [fast] }}
  run {{ steps = 3  watchdog = {watchdog} }}
}}
"""


def run(tmp_path, train_latency="20ms", watchdog="60s"):
    pipeline = tmp_path / "two.rlp"
    pipeline.write_text(PIPELINES.format(train_latency=train_latency, watchdog=watchdog))
    proc = rldsl_here("run", str(pipeline), "--run-dir", str(tmp_path / "run"))
    return proc, tmp_path / "run"


def summary(run_dir: Path, name: str) -> dict:
    return json.loads((run_dir / name / "summary.json").read_text())


def test_two_pipelines_run_together_each_with_its_own_run_directory(tmp_path):
    proc, run_dir = run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fast, slow = summary(run_dir, "fast"), summary(run_dir, "slow")
    assert (fast["pipeline"], fast["steps"], fast["ledger"]["trained"]) == ("fast", 4, 4 * 2 * 4)
    assert (slow["pipeline"], slow["steps"], slow["ledger"]["trained"]) == ("slow", 3, 3 * 2 * 2)
    assert slow["max_lag"] == 0 and fast["max_lag"] <= 1  # each pipeline keeps its own staleness bound
    assert "fast/step 4/4" in proc.stderr and "slow/step 3/3" in proc.stderr  # lines say whose they are
    assert json.loads((run_dir / "run.json").read_text())["pipelines"] == ["fast", "slow"]
    # GPU 1 is shared: both take turns on it through the lease scheduler, and account for it
    assert "GPU lease scheduler: 1 GPUs shared by fast, slow" in proc.stderr
    assert re.search(r"fast/step 1/4 .* replicas 0/0 lease waits", proc.stderr)  # its replica's GPU 0 is its own
    assert re.search(r"slow/step 1/3 .* replicas [01]/1 lease waits", proc.stderr)
    for sharing in (fast["gpu_sharing"], slow["gpu_sharing"]):
        assert sharing["holding"] == [] and sharing["grants"] >= 3 and sharing["gpu_seconds_used"] > 0
    assert len(json.loads((run_dir / "plan.json").read_text())["pipelines"]) == 2


def test_a_stalled_pipeline_fails_the_run_after_the_other_finishes(tmp_path):
    proc, run_dir = run(tmp_path, train_latency="6s", watchdog="3s")  # a call in flight twice the watchdog's time
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "error: the run stopped" in proc.stderr and "no progress" in proc.stderr
    assert summary(run_dir, "fast")["steps"] == 4  # the healthy pipeline ran to its end
    slow = summary(run_dir, "slow")  # written on failure too: how it ended, with the counts so far
    assert slow["exit"] == "failed" and "no progress" in slow["error"] and "generated" in slow["ledger"]
