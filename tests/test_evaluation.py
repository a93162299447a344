"""The evaluator as a weight receiver, in process (the e2e runs cover it on Ray)."""

from pathlib import Path

import torch

from rldsl.compiler.driver import compile_source
from rldsl.runtime.ray_lowering.evaluation import EvaluationSchedule, Evaluator

ROOT = Path(__file__).resolve().parent.parent


def small_plan():
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text().replace("eval_size = 128", "eval_size = 8")
    result = compile_source(text, str(ROOT / "pipelines" / "grpo_async.rlp"))
    assert result.ok, result.diagnostics
    return result.plan.pipeline()


def test_the_evaluator_scores_the_newest_complete_push_and_says_which():
    pipe = small_plan()
    assert pipe.evaluates and pipe.eval_size == 8
    evaluator = Evaluator(pipe, background=False)
    first = evaluator.evaluate(min_version=0)
    assert first["version"] == 0 and first["prompts"] == 8 and 0.0 <= first["accuracy"] <= 1.0

    state = evaluator.decoder.model.module.state_dict()
    pushed = {name: torch.zeros_like(t) for name, t in state.items()}
    names = sorted(pushed)
    evaluator.update_weights({n: pushed[n] for n in names[:3]}, version=1, last=False)
    assert evaluator.version() == 0  # half a push is not a version
    evaluator.update_weights({n: pushed[n] for n in names[3:]}, version=1, last=True)
    assert evaluator.version() == 1

    second = evaluator.evaluate(min_version=1)
    assert second["version"] == 1
    assert all(torch.equal(t, pushed[n]) for n, t in evaluator.decoder.model.module.state_dict().items())
    assert second["accuracy"] == 0.0  # all-zero weights answer nothing right

    late = evaluator.evaluate(min_version=5, timeout_s=0.1)  # never pushed: scores what it has
    assert late["version"] == 1


def test_the_schedule_asks_every_eval_every_steps_but_not_for_the_last():
    schedule = EvaluationSchedule(actor=None, every=10, total_steps=30)
    assert [s for s in range(1, 31) if schedule.due(s)] == [10, 20]
    assert not EvaluationSchedule(actor=None, every=0, total_steps=30).due(10)
