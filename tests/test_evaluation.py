"""The evaluator as a weight receiver, in process (the e2e runs cover it on Ray)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rldsl.compiler.driver import compile_source
from rldsl.runtime.engines.torch.warmstart import greedy_accuracy
from rldsl.runtime.protocols import Prompt
from rldsl.compiler.plan_view import render_plan
from rldsl.runtime.control.settings import settings_from_plan
from rldsl.runtime.ray_lowering.evaluation import EvaluationSchedule, Evaluator, accuracy_change, \
    evaluation_summary, held_out_prompts, score
from rldsl.runtime.ray_lowering.progress import Progress
from rldsl.tasks import load_dataset

ROOT = Path(__file__).resolve().parent.parent


def small_plan():
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text().replace("eval_size = 128", "eval_size = 8")
    result = compile_source(text, str(ROOT / "pipelines" / "grpo_async.rlp"))
    assert result.ok, result.diagnostics
    return result.plan.pipeline()


def with_dataset_options(pipe, **options):
    (dataset,) = pipe.datasets
    return dataclasses.replace(pipe, datasets=[dataclasses.replace(dataset, options={**dataset.options, **options})])


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


@pytest.mark.parametrize(("at_start", "at_end", "every", "asked"), [
    (True, True, 10, [0, 10, 20, 25]),  # the default: the start, the grid and the last step
    (False, False, 10, [10, 20]),  # NeMo RL's val_at_start / val_at_end = false
    (False, False, 5, [5, 10, 15, 20, 25]),  # the grid falls on the last step: evaluated there anyway
    (False, True, 0, [25]),
    (True, False, 0, [0]),
])
def test_the_start_and_the_end_are_evaluated_only_when_the_run_asks(at_start, at_end, every, asked):
    schedule = EvaluationSchedule(actor=None, every=every, total_steps=25, at_start=at_start, at_end=at_end)
    steps = [0] if schedule.at_start else []  # the driver asks for step 0 when the run begins
    steps += [s for s in range(1, 26) if schedule.due(s)] + ([25] if schedule.due_at_end(25) else [])
    assert steps == asked


def test_the_start_and_end_switches_reach_the_plan_and_plan_says_when():
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text()
    skipped = text.replace("eval_every = 10", "eval_every = 10  eval_at_start = false  eval_at_end = false")
    result = compile_source(skipped, str(ROOT / "pipelines" / "grpo_async.rlp"))
    run = result.plan.pipeline().run
    assert (run.eval_at_start, run.eval_at_end, run.eval_every) == (False, False, 10)
    assert "held-out split of builtin:arith; every 10 steps, not at the start or the end" in render_plan(result)
    default = compile_source(text, str(ROOT / "pipelines" / "grpo_async.rlp"))
    assert default.plan.pipeline().run.eval_at_start and "not at the" not in render_plan(default)


def test_a_run_that_asks_for_no_evaluation_starts_no_evaluator():
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text()
    result = compile_source(text.replace("eval_every = 10", "eval_every = 0  eval_at_start = false  "
                                         "eval_at_end = false"), str(ROOT / "pipelines" / "grpo_async.rlp"))
    pipe = result.plan.pipeline()
    assert not pipe.evaluates and not pipe.has_evaluator
    assert "evaluation: none asked for (eval_every = 0, eval_at_start = false, eval_at_end = false)" \
        in render_plan(result)


def test_the_summary_reports_no_change_it_did_not_measure():
    start, middle, end = ({"step": s, "accuracy": a} for s, a in ((0, 0.25), (10, 0.375), (25, 0.5)))
    assert evaluation_summary([start, middle, end], 25) == \
        {"evals": [start, middle, end], "eval_start": 0.25, "eval_end": 0.5}
    assert accuracy_change([start, end], 25) == "0.250 -> 0.500 (+0.250)"
    # no start evaluation, and the last one (step 10) is not the run's last step (25)
    assert evaluation_summary([middle], 25) == {"evals": [middle]}
    assert accuracy_change([middle], 25) == "0.375 at step 10 (the only evaluation)"
    assert accuracy_change([middle, end], 25) == "0.375 (step 10) -> 0.500 (step 25), +0.125"
    assert evaluation_summary([], 25) == {} and accuracy_change([], 25) is None


def test_the_final_table_without_a_start_evaluation_and_with_drops(tmp_path, capsys):
    pipe = small_plan()
    progress = Progress(settings_from_plan(pipe), tmp_path, live=False, log=())
    summary = {"steps": 25, "ledger": {"generated": 800, "trained": 788,
                                       "dropped": {"reward_invalid": 8, "environment_tokenization": 4}},
               "max_lag": 1, "samples_per_s": 10.0, "wall_clock_s": 80.0, "train_loop_s": 70.0,
               **evaluation_summary([{"step": 20, "accuracy": 0.5}], 25)}
    progress.final_table(summary, tmp_path)
    shown = capsys.readouterr().out  # the results: stdout
    assert "0.500 at step 20 (the only evaluation)" in shown
    # each drop reason says what it means
    assert "dropped 8 as reward_invalid: the reward returned something that is not a finite number" in shown
    assert "dropped 4 as environment_tokenization: the conversation did not extend the tokens" in shown


def test_the_default_evaluation_prompts_are_the_first_sources_eval_split():
    pipe = with_dataset_options(small_plan(), sources=["builtin:reverse", "builtin:arith"], weights=[1.0, 1.0])
    pipe = dataclasses.replace(pipe, datasets=[dataclasses.replace(pipe.datasets[0], source="builtin:reverse")])
    expected = load_dataset("builtin:reverse", "eval", seed=pipe.run.seed)[:8]
    assert [p.text for p in held_out_prompts(pipe)] == [p.text for p in expected]


def test_an_eval_source_replaces_the_held_out_split(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(12)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pipe = with_dataset_options(small_plan(), eval_source=f"jsonl:{tmp_path}/{{split}}.jsonl")
    assert [p.text for p in held_out_prompts(pipe)] == [r["prompt"] for r in rows[:8]]  # eval_size of them
    builtin = with_dataset_options(small_plan(), eval_source="builtin:reverse")
    assert all(p.text.startswith("reverse ") for p in held_out_prompts(builtin))


def test_scores_average_every_response_and_count_prompts_with_one_right():
    prompts = [Prompt(0, "1+1=", "2"), Prompt(1, "2+2=", "4")]
    assert score([["2", "3", "2", "2"], ["5", "5", "5", "5"]], prompts) == {"accuracy": 3 / 8, "pass_at_k": 0.5}
    assert score([["2"], ["4"]], prompts) == {"accuracy": 1.0, "pass_at_k": 1.0}


def test_greedy_evaluation_is_todays_greedy_accuracy():
    evaluator = Evaluator(small_plan(), background=False)
    result = evaluator.evaluate()
    assert result["samples"] == 1 and result["pass_at_k"] == result["accuracy"]
    assert result["accuracy"] == greedy_accuracy(evaluator.decoder.model, evaluator.prompts,
                                                 evaluator.decoder.max_new_tokens)


def test_sampled_evaluation_is_reproducible_for_a_version():
    pipe = with_dataset_options(small_plan(), eval_samples=4, eval_temperature=1.0, eval_top_p=0.9)
    evaluator = Evaluator(pipe, background=False)
    first, again = evaluator.evaluate(), evaluator.evaluate()
    assert first == again  # seeded by the run's seed and the weight version
    assert first["samples"] == 4 and first["prompts"] == 8
    assert 0.0 <= first["accuracy"] <= first["pass_at_k"] <= 1.0
    responses = evaluator.responses()
    assert [len(r) for r in responses] == [4] * 8
    assert len({text for group in responses for text in group}) > 8  # sampled, not argmax repeated


def test_sampling_options_are_checked_when_the_evaluator_starts():
    with pytest.raises(ValueError, match="top_p"):
        Evaluator(with_dataset_options(small_plan(), eval_temperature=1.0, eval_top_p=1.5), background=False)
