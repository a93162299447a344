"""The settings that give the peers' semantics (docs/migrating.md; compared with
the peers' code in tests/test_conformance_*.py): from the .rlp file to the
plan, the controller and the trainers; the compiler's checks; files that
leave them out keep their meaning; and each trainer averaging its forwards'
token means under ``agg = micro_token_mean``."""

from __future__ import annotations

import copy

import pytest
import torch

from rldsl.runtime.control.settings import settings_from_plan
from rldsl.runtime.engines.factory import training_options
from rldsl.runtime.engines.megatron import rows as megatron_rows
from rldsl.runtime.engines.policy_loss import PolicyLossConfig, policy_loss
from rldsl.runtime.engines.torch.common import response_logprobs
from rldsl.runtime.engines.torch.train import TorchTrainer
from tests import test_fsdp_engine, test_megatron_engine
from tests.test_policy_loss import ADVANTAGES, BEHAVIOUR, LOGPROBS, MASK, REFERENCE
from tests.test_split_step_gradient import make_batch, make_model
from tests.test_training_keys import compiled

NEW_LOSS_ARGS = ("length_norm", "count_masked", "rejected", "rejected_in_ratio", "kl_weighted")


def test_the_settings_reach_the_plan_the_controller_and_the_trainer():
    pipe = compiled("  advantage = reinforce_pp_baseline\n  normalize = batch_tokens\n  advantage_eps = 0\n"
                    "  advantage_std = biased\n  reward_clip = 10\n  reward_clip_at = after_baseline\n"
                    "  loss = grpo(agg = seq_mean_token_sum, length_norm = 1024, count_masked = true,"
                    " correction = mis, rejected = unmask, rejected_in_ratio = false,"
                    " kl_weighted = true)").plan.pipeline()
    settings = settings_from_plan(pipe)
    assert (settings.normalize, settings.advantage_eps, settings.advantage_std, settings.reward_clip,
            settings.reward_clip_at) == ("batch_tokens", 0.0, "biased", 10.0, "after_baseline")
    trainer = TorchTrainer(make_model(), **training_options(pipe.stage("actor"), pipe))
    assert (trainer.loss.agg, trainer.loss.length_norm, trainer.loss.count_masked, trainer.loss.rejected,
            trainer.loss.rejected_in_ratio, trainer.loss.kl_weighted) == \
        ("seq_mean_token_sum", 1024.0, True, "unmask", False, True)
    assert trainer.loss.count_name == "loss_count"
    assert compiled("  normalize = group_batch_tokens").plan.pipeline().stage("actor").settings["normalize"] == \
        "group_batch_tokens"
    assert settings_from_plan(compiled("  normalize = batch_std").plan.pipeline()).normalize == "batch_std"


def test_files_without_them_keep_their_meaning():
    pipe = compiled().plan.pipeline()
    loss = pipe.stage("actor").settings["loss"]
    assert not set(NEW_LOSS_ARGS) & set(loss)
    assert PolicyLossConfig(**training_options(pipe.stage("actor"), pipe)["loss"]) == PolicyLossConfig()
    settings = settings_from_plan(pipe)
    assert (settings.advantage_eps, settings.advantage_std, settings.reward_clip_at) == \
        (1e-6, "unbiased", "before_baseline")
    old_plan_settings = {name: value for name, value in pipe.stage("actor").settings.items()
                         if name not in ("advantage_eps", "advantage_std", "reward_clip_at")}
    pipe.stage("actor").settings.clear()
    pipe.stage("actor").settings.update(old_plan_settings)  # a plan saved before the keys existed
    assert (settings_from_plan(pipe).advantage_eps, settings_from_plan(pipe).reward_clip_at) == \
        (1e-6, "before_baseline")


@pytest.mark.parametrize(("loss", "message"), [
    ("length_norm = 1024", "length_norm with agg = token_mean"),
    ("agg = seq_mean_token_mean, length_norm = 1024", "length_norm with agg = seq_mean_token_mean"),
    ("count_masked = true", "count_masked with agg = token_mean"),
    ("agg = micro_token_mean, count_masked = true", "count_masked with agg = micro_token_mean"),
    ("kl_in = reward, kl_weighted = true", "kl_weighted with kl_in = reward"),
])
def test_variants_that_would_do_nothing_are_rlp312(loss, message):
    from rldsl.compiler.driver import compile_source
    from tests.test_training_keys import BASE, TRAIN

    result = compile_source(BASE.replace(TRAIN, f"  prompts_per_step = 8\n  loss = grpo({loss})\n}}"), "t.rlp")
    assert [d.code for d in result.diagnostics] == ["RLP312"]
    assert result.diagnostics[0].message.startswith(message)


@pytest.mark.parametrize("train", ["  loss = grpo(rejected = keep)", "  advantage_std = sample",
                                   "  reward_clip_at = after", "  normalize = tokens", "  advantage_eps = -1"])
def test_values_outside_the_types_are_refused(train):
    from rldsl.compiler.driver import compile_source
    from tests.test_training_keys import BASE, TRAIN

    result = compile_source(BASE.replace(TRAIN, f"  prompts_per_step = 8\n{train}\n}}"), "t.rlp")
    assert not result.ok


# -- what a rejected token keeps (the inputs of test_policy_loss.py) ------------------------------


def test_what_a_rejected_token_keeps():
    """mis at [0.6, 2]: w = 0.5 (d = -1) and 4.0 (d = 0) rejected, k1 KL 0.1 d per token; the other tokens'
    loss -A w: -(1 + 1.5) + 2 x 0.7 = -1.1 and their KL 0.1 (0 + 0.5 + 0.2) = 0.07."""
    def loss(rejected):
        config = PolicyLossConfig(correction="mis", correction_low=0.6, kl=0.1, kl_estimator="k1", rejected=rejected)
        out = policy_loss(LOGPROBS, BEHAVIOUR, ADVANTAGES, MASK, config, REFERENCE)
        return round(float(out.loss_sum), 6), out.count

    assert loss("drop") == (round(-1.1 + 0.07, 6), 5.0)  # out of the loss, still counted
    assert loss("zero") == (round(-1.1 + 0.07 - 0.1, 6), 5.0)  # its KL term stays
    assert loss("unmask") == (round(-1.1 + 0.07, 6), 3.0)  # out of the count too


# -- each forward's token mean in every trainer ------------------------------------------------


MICRO = PolicyLossConfig(clip=0.2, kl=0.05, agg="micro_token_mean")


def forward_mean_gradients(model, batch, forwards: list[list[int]]) -> list[torch.Tensor]:
    """The reference: each forward's policy_loss over its own tokens, averaged over the forwards."""
    model = copy.deepcopy(model)
    total = 0.0
    for rows in forwards:
        part = {name: value[rows] for name, value in batch.items()}
        out = policy_loss(response_logprobs(model, part), part["behaviour_logprobs"], part["advantage"],
                          part["response_mask"], MICRO, part["ref_logprobs"])
        total = total + out.loss_sum
    (total / len(forwards)).backward()
    return [p.grad.clone() for p in model.module.parameters()]


def trainer_gradients(trainer, batch, calls):
    trainer.begin_train_step(0)
    for start, stop in calls:
        trainer.train_microbatch(0, {name: value[start:stop] for name, value in batch.items()})
    trainer.finish_train_step(0)
    return [p.grad.clone() for p in trainer.parameters]


# two train_microbatch calls of 5 rows, 3 rows per forward: forwards [0, 1, 2], [3, 4], [5, 6, 7], [8, 9] of
# each call's rows (torch, megatron), or [0, 1, 2], [3, 4, 5], [6, 7, 8], [9] of the mini-batch's (fsdp)
CALLS, FORWARDS = [(0, 5), (5, 10)], [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]
MINI_BATCH_FORWARDS = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def assert_close(actual, expected):
    worst = max(float((a - e).abs().max()) for a, e in zip(actual, expected))
    assert worst < 1e-5 * max(float(e.abs().max()) for e in expected)


def test_the_torch_trainer_averages_its_forwards_token_means():
    model = make_model()
    batch = make_batch(model)
    trainer = TorchTrainer(copy.deepcopy(model), loss=MICRO, lr=0.0, max_grad_norm=None, rows_per_forward=3)
    assert_close(trainer_gradients(trainer, batch, CALLS), forward_mean_gradients(model, batch, FORWARDS))


def test_the_fsdp_trainer_averages_its_mini_batch_forwards_token_means(one_process_group):
    from rldsl.runtime.engines.fsdp import FsdpTrainer

    model = make_model()
    batch = make_batch(model)
    trainer = FsdpTrainer(copy.deepcopy(model), loss=MICRO, lr=0.0, max_grad_norm=None, rows_per_forward=3)
    actual = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
              for p in _after(trainer_gradients, trainer, batch)]
    assert_close(actual, forward_mean_gradients(model, batch, MINI_BATCH_FORWARDS))


def test_rows_joined_keep_their_logprobs():
    """The fsdp trainer joins a rank's microbatches for a mean per forward: rows of different prompt and
    response widths, padded on the left and on the right, score as they did alone."""
    from rldsl.runtime.engines.torch.packing import concat_rows, take_rows, trim_padding

    model = make_model()
    batch = make_batch(model)
    parts = [trim_padding(take_rows(batch, rows)) for rows in ([0, 4, 8], [1, 2], [3])]  # unequal widths
    assert len({part["prompt_ids"].shape[1] for part in parts}) > 1
    joined = concat_rows(parts)
    with torch.no_grad():
        alone = [response_logprobs(model, part) * part["response_mask"] for part in parts]
        together = response_logprobs(model, joined) * joined["response_mask"]
    row = 0
    for part, expected in zip(parts, alone):
        rows, width = expected.shape
        assert torch.allclose(together[row:row + rows, :width], expected, atol=1e-5)
        assert not together[row:row + rows, width:].any()
        row += rows


def _after(gradients_of, trainer, batch):
    gradients_of(trainer, batch, CALLS)
    return [p for p in trainer.parameters]


@pytest.mark.megatron
def test_the_megatron_trainer_averages_its_pipeline_microbatches_token_means(megatron):
    shape = test_megatron_engine.SHAPES["llama"]
    weights = test_megatron_engine.random_hf_weights(shape, seed=1)
    batch = test_megatron_engine.make_batch(shape)
    expected = megatron_reference(megatron, shape, weights, batch, FORWARDS)
    trainer = test_megatron_engine.make_trainer(shape, weights, loss=MICRO, rows_per_forward=3)
    trainer.begin_train_step(0)
    for start, stop in CALLS:
        trainer.train_microbatch(0, {name: value[start:stop] for name, value in batch.items()})
    trainer.finish_train_step(0)
    actual = {name: p.main_grad for name, p in trainer.model.module.named_parameters()}
    scale = max(float(g.abs().max()) for g in expected.values())
    assert max(float((actual[n] - expected[n]).abs().max()) for n in expected) / scale < 1e-5


def megatron_reference(megatron, shape, weights, batch, forwards):
    model = megatron.build_gpt_model(shape, megatron.transformer_config(shape, "fp32"))
    megatron.load_hf_weights(model, weights, shape)
    total = 0.0
    for rows in forwards:
        part = {name: value[rows] for name, value in batch.items()}
        packed = megatron_rows.pack_rows(part, "cpu")
        logprobs = megatron_rows.response_logprobs_from_logits(megatron_rows.forward_logits(model, packed), packed)
        out = policy_loss(logprobs, part["behaviour_logprobs"], part["advantage"], part["response_mask"], MICRO,
                          part["ref_logprobs"])
        total = total + out.loss_sum
    (total / len(forwards)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


# -- the controller computes the advantages with them -----------------------------------------


def test_the_controller_passes_the_token_counts_the_std_and_the_clip_place():
    """group_batch_tokens needs each sample's trained tokens from the generator; advantage_std, advantage_eps
    and reward_clip_at reach compute_advantages (sim engines, one process: tests/test_difficulty_mask.py)."""
    from rldsl.runtime.control.advantages import compute_advantages
    from tests.test_controller import make_settings
    from tests.test_difficulty_mask import run

    options = dict(advantage_eps=0.0, advantage_std="biased", reward_clip=0.4, reward_clip_at="after_baseline")
    settings = make_settings(prompts_per_step=3, samples_per_prompt=4, steps=1, max_lag=0, advantage="grpo",
                             normalize="group_batch_tokens", **options)
    _, _, trained, _ = run(settings)
    groups = sorted(trained)
    rewards = [trained[g][0] for g in groups]
    tokens = [[int(n) for n in trained[g][2]] for g in groups]
    expected = compute_advantages(rewards, "grpo", "group_batch_tokens", 0.0, 0.4, tokens=tokens, std="biased",
                                  reward_clip_at="after_baseline")
    for group, advantages in zip(groups, expected):
        assert trained[group][1] == pytest.approx(advantages, abs=1e-5)
