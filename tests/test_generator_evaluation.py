"""`dataset { eval_on = generators }`: held-out evaluation decoded by the
generator replicas, with the weights they hold, scored as the evaluator
scores, bounded by `eval_timeout`, never counted as training samples."""

from __future__ import annotations

import json

import pytest

from rldsl.runtime.engines.batching import ContinuousBatcher
from rldsl.runtime.engines.factory import build_generator
from rldsl.runtime.ray_lowering.evaluation import Evaluator
from rldsl.runtime.ray_lowering.generator_evaluation import ReplicaEvaluation

from tests.runs import run_text
from tests.test_eval_timeout import SLOW_EVAL
from tests.test_evaluation import small_plan, with_dataset_options


def replica(pipe):
    generate = next(s for s in pipe.stages if s.kind == "generate")
    return ContinuousBatcher(build_generator(generate, pipe, seed=pipe.run.seed))


@pytest.mark.parametrize("sampling", [{}, {"eval_samples": 3, "eval_temperature": 1.0, "eval_top_p": 0.9}])
def test_a_replica_scores_as_the_evaluator_does_with_the_weights_it_holds(sampling):
    pipe = with_dataset_options(small_plan(), **sampling)
    batcher = replica(pipe)
    try:
        engine = batcher.engine
        engine.version = 3  # the weights it holds now: the result names them
        training_sampling = (engine.temperature, engine.top_p)
        result = ReplicaEvaluation(pipe, replica=0).evaluate(batcher)
        evaluator = Evaluator(pipe, background=False)  # the same weights, on the CPU copy
        evaluator.decoder.version = 3  # sampled responses are seeded by the version
        expected = evaluator.evaluate()
        assert result["version"] == 3 and result["on"] == "generators" and result["replica"] == 0
        assert {k: result[k] for k in ("accuracy", "pass_at_k", "prompts", "samples", "metric")} == \
            {k: expected[k] for k in ("accuracy", "pass_at_k", "prompts", "samples", "metric")}
        assert (engine.temperature, engine.top_p) == training_sampling  # the run's sampling is back
        assert batcher.stats()["requests"] == 0  # no training request was made or counted
    finally:
        batcher.close()


def test_an_evaluation_past_its_deadline_stops_between_chunks_and_says_so():
    pipe = with_dataset_options(small_plan(), eval_size=64)
    batcher = replica(pipe)
    try:
        result = ReplicaEvaluation(pipe, replica=0).evaluate(batcher, timeout_s=1e-6)
        assert result["timed_out"] and result["decoded"] < result["prompts"] == len(ReplicaEvaluation(pipe, 0).prompts)
    finally:
        batcher.close()


ON_GENERATORS = SLOW_EVAL.replace('eval_metric = "tests.reward_fns:slow_echo"', "eval_on = generators") \
    .replace("eval_timeout = 1s", "eval_every = 1")


@pytest.mark.ray
def test_a_run_evaluates_on_its_generators_and_records_the_version_used(tmp_path):
    assert ON_GENERATORS != SLOW_EVAL
    run, run_dir, summary = run_text(tmp_path, ON_GENERATORS)
    assert summary["exit"] == "finished" and summary["steps"] == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval")]
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert all(e["on"] == "generators" for e in evals)
    assert evals[0]["version"] == 0 and evals[-1]["version"] >= 1  # the weights the replica held
    assert "on generator replica 0" in run.stderr
    ledger = summary["ledger"]  # evaluation rows (8 prompts, 3 times) are no training samples
    assert ledger["open"] == 0 and ledger["trained"] + sum(ledger["dropped"].values()) == ledger["generated"]
    assert ledger["trained"] == 2 * 2 * 2  # steps x prompts_per_step x samples_per_prompt
    keys = {key for line in (run_dir / "journal.jsonl").read_text().splitlines()
            for key in json.loads(line).get("keys", [])}
    assert len(keys) == ledger["generated"]


@pytest.mark.ray
def test_an_evaluation_on_the_generators_past_its_timeout_ends_the_run_cleanly(tmp_path):
    text = SLOW_EVAL.replace('eval_metric = "tests.reward_fns:slow_echo"',
                             'eval_metric = "tests.reward_fns:slow_echo"  eval_on = generators')
    run, _, summary = run_text(tmp_path, text)
    assert summary["exit"] == "finished" and summary["steps"] == 2
    assert [entry["step"] for entry in summary["eval_timeouts"]][-1] == 2  # the final evaluation
    assert "eval @ step 2: timed out after 1s" in run.stdout + run.stderr
