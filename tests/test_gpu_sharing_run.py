"""`rldsl run` of pipelines that take turns on shared GPUs: the cluster's
lease scheduler actor governs them, and when it dies every pipeline stops
with an error naming it, its ledger balanced."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

from tests.test_supervision import run_and_kill  # noqa: E402

# Two pipelines taking turns on both GPUs (the smallest sharing: each one's
# generator on the GPU of the other's trainer); pipelines/sim_shared_gpus.rlp
# shares four, with more actors than this needs.
SHARED = """
cluster { nodes = 1  gpus_per_node = 2 }
pipeline a {
  model policy { source = "builtin:tiny-lm" }
  dataset prompts { source = "builtin:arith" }
  stage generate rollout { model = policy  engine = sim(latency = 60ms)  gpus = [0]  samples_per_prompt = 4 }
  stage reward score { fn = "rldsl.rewards:exact_match" }
  stage train actor { model = policy  engine = sim(latency = 10ms)  gpus = [1]  prompts_per_step = 4 }
  stage sync weights { from = actor  to = rollout }
  flow prompts -> rollout -> score -> actor
  staleness { max_lag = 1 }
  run { steps = 200  watchdog = 60s }
}
pipeline b {
  model policy { source = "builtin:tiny-lm" }
  dataset prompts { source = "builtin:reverse" }
  stage generate rollout { model = policy  engine = sim(latency = 60ms)  gpus = [1]  samples_per_prompt = 4 }
  stage reward score { fn = "rldsl.rewards:char_match" }
  stage train actor { model = policy  engine = sim(latency = 10ms)  gpus = [0]  prompts_per_step = 4 }
  stage sync weights { from = actor  to = rollout }
  flow prompts -> rollout -> score -> actor
  staleness { max_lag = 1 }
  placement { share = [a] }
  run { steps = 200  watchdog = 60s }
}
"""

pytestmark = [pytest.mark.ray]


def test_a_dead_gpu_scheduler_stops_every_pipeline_with_a_named_error(tmp_path):
    # killed once both pipelines have 2 steps (taking turns, either may be a step behind the other)
    result, run_dir = run_and_kill(tmp_path, "gpu-scheduler", text=SHARED,
                                   metrics=("a/metrics.jsonl", "b/metrics.jsonl"))
    stderr = result.stderr
    assert result.returncode == 3, stderr[-3000:]
    assert "GPU lease scheduler actor `gpu-scheduler` died" in stderr
    assert "Traceback" not in stderr
    for name in ("a", "b"):
        summary = json.loads((run_dir / name / "summary.json").read_text())
        assert summary["exit"] == "failed" and "GPU lease scheduler" in summary["error"], name
        ledger = summary["ledger"]  # every sample accounted for: trained, dropped, or open when it stopped
        assert ledger["generated"] == ledger["trained"] + sum(ledger["dropped"].values()) + ledger["open"]
        assert 2 <= summary["steps"] < 200
        assert "did not answer" in summary["gpu_sharing"]["error"]  # the figures died with it, and it says so
