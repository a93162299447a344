"""The training-semantics keys from the .rlp file to the plan: mini-batches,
the loss family, schedules, run length, mixtures, and `plan`'s equivalence
lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.compiler.plan_view import render_plan
from rldsl.runtime.control.settings import settings_from_plan
from rldsl.runtime.ray_lowering.launch import with_run_lengths

BASE = (Path(__file__).parent / "golden" / "base.rlp").read_text()
TRAIN = "  prompts_per_step = 8\n}"


def compiled(train: str = "", extra: str = "", dataset: str | None = None, base_dir: Path | None = None):
    text = BASE.replace(TRAIN, f"  prompts_per_step = 8\n{train}\n}}") + extra
    if dataset is not None:
        text = text.replace('dataset prompts { source = "builtin:arith" }', dataset)
    result = compile_source(text, "t.rlp", base_dir=base_dir)
    assert result.ok, [d.message for d in result.diagnostics]
    return result


def test_mini_batches_epochs_and_the_loss_family_reach_the_plan():
    result = compiled("  global_batch = 8\n  ppo_epochs = 2\n  micro_batch = 4\n  micro_batch_tokens = 512\n"
                      "  advantage = rloo\n  lr_schedule = cosine\n  warmup = 3\n  min_lr = 1e-6\n"
                      "  loss = grpo(clip = 0.2, clip_high = 0.28, dual_clip = 3.0, kl = 0.0, kl_estimator = k2,"
                      " kl_in = reward, agg = seq_mean_token_sum, ratio = sequence)")
    pipe = result.plan.pipeline()
    batch, train = pipe.batch, pipe.stage("actor").settings
    assert (batch.rollout_batch, batch.global_batch, batch.minibatches, batch.ppo_epochs) == (32, 8, 4, 2)
    assert train["loss"] == {"name": "grpo", "clip": 0.2, "clip_high": 0.28, "dual_clip": 3.0, "kl": 0.0,
                             "kl_estimator": "k2", "kl_in": "reward", "agg": "seq_mean_token_sum",
                             "ratio": "sequence", "behaviour_cap": 0.0, "kl_input_clamp": 0.0,
                             "kl_output_clamp": 0.0, "correction": "none", "correction_level": "token"}
    assert (train["advantage"], train["normalize"]) == ("rloo", "none")  # the estimator's scaling, written out
    assert (train["lr_schedule"], train["warmup"], train["min_lr"], train["micro_batch_tokens"]) == \
        ("cosine", 3, 1e-6, 512)
    settings = settings_from_plan(pipe)
    assert (settings.minibatch_groups, settings.ppo_epochs, settings.advantage) == (2, 2, "rloo")
    text = render_plan(result)
    assert "32 per step (4 optimizer steps of 8, 2 epochs), forwards of <= 512 tokens" in text
    assert "actor.ppo_mini_batch_size = 2, ppo_epochs = 2, use_dynamic_bsz = True" in text
    assert "train_batch_size = 8" in text and "actor.ppo_n_minibatches = 4" in text
    assert "run: 20 steps, 160 optimizer steps, seed 0" in text


@pytest.mark.parametrize(("estimator", "scaling"), [("grpo", "group"), ("dr_grpo", "none"), ("rloo", "none"),
                                                    ("reinforce_pp", "batch"), ("reinforce_pp_baseline", "batch")])
def test_each_estimator_has_its_default_scaling_and_normalize_overrides_it(estimator, scaling):
    assert compiled(f"  advantage = {estimator}").plan.pipeline().stage("actor").settings["normalize"] == scaling
    overridden = compiled(f"  advantage = {estimator}\n  normalize = none").plan.pipeline()
    assert overridden.stage("actor").settings["normalize"] == "none"


def test_run_length_in_samples_rounds_up_to_whole_steps():
    run = compiled(extra="run { samples = 100 }\n").plan.pipeline().run
    assert (run.steps, run.samples) == (4, 100)  # 100 samples / 32 per step


def test_run_length_in_epochs_is_counted_from_the_training_prompts(tmp_path):
    rows = "\n".join(f'{{"prompt": "q{i}", "answer": "a"}}' for i in range(40))
    (tmp_path / "train.jsonl").write_text(rows + "\n")
    result = compiled(extra="run { epochs = 3 }\n", dataset='dataset prompts { source = "jsonl:train.jsonl" }',
                      base_dir=tmp_path)
    assert result.plan.pipeline().run.steps == 0
    assert "3 epochs (steps counted when the dataset is read)" in render_plan(result)
    resolved = with_run_lengths(result.plan, None).pipeline().run
    from rldsl.tasks import is_eval_text

    trained = sum(not is_eval_text(f"q{i}") for i in range(40))  # the file has no {split}: its eval share is held out
    assert 0 < trained < 40 and resolved.steps == 3 * trained // 8
    assert with_run_lengths(result.plan, 7).pipeline().run.steps == 7  # --steps wins


@pytest.mark.parametrize(("written", "steps", "words"), [
    ("steps = 3  samples = 100", 3, "(steps = 3 ends the run before samples = 100, which would take 4)"),
    ("steps = 9  samples = 100", 4, "(samples = 100 ends the run before steps = 9)"),
    ("steps = 4  samples = 100", 4, "(samples = 100 and steps = 4 end the run together)"),
])
def test_steps_beside_samples_end_the_run_at_whichever_comes_first(written, steps, words):
    result = compiled(extra=f"run {{ {written} }}\n")  # 100 samples / 32 per step: 4 steps
    run = result.plan.pipeline().run
    assert (run.steps, run.samples) == (steps, 100)
    assert f"run: {steps} steps {words}" in render_plan(result)


@pytest.mark.parametrize(("cap", "steps", "words"), [
    (2, 2, "steps = 2 ends it before 3 epochs of {n} training prompts"),
    (500, None, "3 epochs of {n} training prompts end it before steps = 500"),
])
def test_steps_beside_epochs_end_the_run_at_whichever_comes_first(tmp_path, cap, steps, words):
    rows = "\n".join(f'{{"prompt": "q{i}", "answer": "a"}}' for i in range(40))
    (tmp_path / "train.jsonl").write_text(rows + "\n")
    result = compiled(extra=f"run {{ steps = {cap}  epochs = 3 }}\n", base_dir=tmp_path,
                      dataset='dataset prompts { source = "jsonl:train.jsonl" }')
    run = result.plan.pipeline().run
    assert (run.steps, run.epochs, run.max_steps) == (0, 3, cap)  # counted when the dataset is read
    assert f"run: {cap} steps or 3 epochs, whichever is reached first" in render_plan(result)
    said = []
    resolved = with_run_lengths(result.plan, None, say=said.append).pipeline().run
    from rldsl.tasks import is_eval_text

    trained = sum(not is_eval_text(f"q{i}") for i in range(40))
    assert resolved.steps == (steps or 3 * trained // 8) < 500
    assert said == [f"demo: the run takes {resolved.steps} steps: {words.format(n=trained)}"
                    + ("" if steps is None else f" ({3 * trained // 8} steps)")]
    assert with_run_lengths(result.plan, 7).pipeline().run.steps == 7  # --steps still wins over both


def test_steps_beside_epochs_is_no_longer_an_error_but_epochs_beside_samples_is():
    assert not [d for d in compile_source(BASE + "run { steps = 5  epochs = 2 }\n", "t.rlp").diagnostics]
    for written in ("epochs = 2  samples = 100", "steps = 5  epochs = 2  samples = 100"):
        found = compile_source(BASE + f"run {{ {written} }}\n", "t.rlp").diagnostics
        assert [d.code for d in found] == ["RLP309"] and "epochs = 2, samples = 100" in found[0].message


def test_warmup_is_checked_against_the_steps_that_cap_a_run_in_epochs():
    text = BASE.replace(TRAIN, "  prompts_per_step = 8\n  warmup = 10\n}")
    found = compile_source(text + "run { steps = 5  epochs = 3 }\n", "t.rlp").diagnostics
    assert [d.code for d in found] == ["RLP311"] and "the run takes at most 5:" in found[0].message
    assert compile_source(text + "run { epochs = 3 }\n", "t.rlp").diagnostics == []  # unknown before the data


def test_a_mixture_and_an_evaluation_dataset_reach_the_plan(tmp_path):
    (tmp_path / "eval.jsonl").write_text('{"prompt": "q", "answer": "a"}\n')
    result = compiled(dataset='dataset prompts {\n  sources = ["builtin:arith", "builtin:reverse"]\n'
                              '  weights = [3, 1]\n  eval_source = "jsonl:eval.jsonl"\n  eval_samples = 4\n'
                              '  eval_temperature = 0.6\n  eval_top_p = 0.95\n}', base_dir=tmp_path)
    dataset = result.plan.pipeline().datasets[0]
    assert dataset.source == "builtin:arith"
    assert dataset.options["sources"] == ["builtin:arith", "builtin:reverse"]
    assert dataset.options["weights"] == [3, 1]
    assert dataset.options["eval_source"] == f"jsonl:{tmp_path / 'eval.jsonl'}"
    assert (dataset.options["eval_samples"], dataset.options["eval_temperature"], dataset.options["eval_top_p"]) \
        == (4, 0.6, 0.95)


def test_plan_names_each_frameworks_staleness_knob_and_none_for_a_synchronous_pipeline():
    asynchronous = render_plan(compiled())
    assert "ROLL: async_generation_ratio = 1" in asynchronous
    assert "generate_ahead_steps" not in asynchronous
    assert "max_head_offpolicyness = 1" in asynchronous
    synchronous = render_plan(_synchronous())
    assert "all five: their synchronous loop (no asynchronous setting)" in synchronous
    for knob in ("async_generation_ratio", "max_head_offpolicyness", "max_trajectory_age_steps", "--async_train"):
        assert knob not in synchronous


def _synchronous():
    text = BASE.replace("staleness { max_lag = 1 }", "staleness { max_lag = 0 }")
    text = text.replace("  gpus = 2\n  samples_per_prompt", "  colocate = actor\n  samples_per_prompt")
    result = compile_source(text, "t.rlp")
    assert result.ok, [d.message for d in result.diagnostics]
    return result
