"""A held-out evaluation bounded by `run { eval_timeout }`: one that
overruns is reported as timed out and the run still ends cleanly."""

from __future__ import annotations


import pytest

from rldsl.runtime.ray_lowering.evaluation import EvaluationSchedule, describe_timeout

from tests.runs import run_text, shared_ray

SLOW_EVAL = """
pipeline slow_eval
cluster { nodes = 1  gpus_per_node = 2 }
model policy { source = "builtin:tiny-lm" }
dataset prompts { source = "builtin:arith"  eval_size = 8  eval_metric = "tests.reward_fns:slow_echo" }
stage generate rollout { model = policy  engine = torch  gpus = 1  samples_per_prompt = 2  max_new_tokens = 4 }
stage reward score { fn = "rldsl.rewards:exact_match" }
stage train actor { model = policy  engine = torch  gpus = 1  prompts_per_step = 2  micro_batch = 4 }
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> actor
staleness { max_lag = 1 }
run { steps = 2  watchdog = 120s  eval_timeout = 1s }
"""


def test_the_schedule_reports_an_evaluation_past_its_deadline_and_stops_waiting():
    ray = pytest.importorskip("ray")
    shared_ray()

    @ray.remote(num_cpus=0)
    class Slow:
        def evaluate(self, min_version):
            import time
            time.sleep(30)
            return {"accuracy": 1.0}

    slow = Slow.remote()
    try:
        schedule = EvaluationSchedule(slow, every=0, total_steps=1, timeout_s=0.5)
        schedule.request(step=1, version=1)
        assert schedule.collect() == ([], [])  # polling: not due yet, still pending
        finished, expired = schedule.collect(wait=True)  # returns at the deadline, not after 30 s
        assert finished == [] and expired == [{"step": 1, "version": 1, "timeout_s": 0.5}]
        assert schedule.pending == [] and schedule.timed_out == expired
        assert "timed out after 0.5s" in describe_timeout(expired[0])
    finally:
        ray.kill(slow)


def test_a_stop_finishes_the_evaluations_in_flight_within_its_budget_and_skips_the_rest(tmp_path):
    ray = pytest.importorskip("ray")
    shared_ray()

    @ray.remote(num_cpus=0)
    class Evaluator:
        def evaluate(self, min_version):
            import time
            time.sleep(0.1 if min_version == 1 else 30)
            return {"accuracy": 0.5, "version": min_version, "prompts": 8}

    actor = Evaluator.options(max_concurrency=2).remote()
    try:
        schedule = EvaluationSchedule(actor, every=0, total_steps=3)
        schedule.request(step=1, version=1)
        schedule.request(step=2, version=2)
        finished, skipped = schedule.finish_within(3.0)  # returns within the budget, not after 30 s
        assert [r["step"] for r in finished] == [1] and skipped == [{"step": 2, "version": 2}]
        assert schedule.pending == [] and [r["step"] for r in schedule.done] == [1]
    finally:
        ray.kill(actor)

    # the resume from version 2 asks for the skipped evaluation first
    import json
    from types import SimpleNamespace

    from rldsl.runtime.ray_lowering.pipeline_evaluations import PipelineEvaluations

    (tmp_path / "summary.json").write_text(json.dumps({"eval_skipped": skipped + [{"step": 1, "version": 1}]}))
    asked = []
    driver = SimpleNamespace(run_dir=tmp_path, evaluations=SimpleNamespace(
        request=lambda step, version: asked.append((step, version))))
    PipelineEvaluations.redo_skipped_evaluations(driver, version=2)
    assert asked == [(2, 2)]  # version 1's weights are gone: not asked


@pytest.mark.ray
def test_an_evaluation_past_its_timeout_ends_the_run_cleanly_and_says_so(tmp_path):
    run, _, summary = run_text(tmp_path, SLOW_EVAL, name="slow_eval.rlp")
    assert summary["exit"] == "finished" and summary["steps"] == 2
    assert [entry["step"] for entry in summary["eval_timeouts"]][-1] == 2  # the final evaluation
    assert "eval @ step 2: timed out after 1s" in run.stdout + run.stderr
