"""rldsl against verl's own functions (verl 0.9.1: ``verl.trainer.ppo.core_algos``
and ``rollout_corr_helper``), value and gradient within 1e-5 in float64
(tests/peers.py). Each test names the docs/migrating.md row it backs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rldsl.compiler.driver import compile_file
from rldsl.runtime.control.advantages import compute_advantages
from rldsl.runtime.engines.factory import loss_options
from rldsl.runtime.engines.policy_loss import PolicyLossConfig
from tests.peers import (
    assert_same,
    assert_values,
    difference,
    flat,
    import_peer,
    random_batch,
    rldsl_loss,
    value_and_grad,
)

core, correction, actor, algo = import_peer("verl", "verl.trainer.ppo.core_algos", "verl.trainer.ppo.rollout_corr_helper",
                                            "verl.workers.config.actor", "verl.trainer.config")
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
AGGS = {"token-mean": "token_mean", "seq-mean-token-sum": "seq_mean_token_sum",
        "seq-mean-token-mean": "seq_mean_token_mean"}
LOW_VAR_KL = {"kl_input_clamp": 20.0, "kl_output_clamp": 10.0}  # verl's low_var_kl bounds


def actor_config(clip_low=0.2, clip_high=0.28, clip_c=3.0, agg="token-mean", **global_batch_info):
    config = actor.ActorConfig(strategy="fsdp", rollout_n=4, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                               clip_ratio=clip_low, clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                               clip_ratio_c=clip_c, loss_agg_mode=agg)
    config.global_batch_info.update(global_batch_info)
    return config


def group_ids(batch) -> np.ndarray:
    return np.arange(batch.rows) // batch.group_size


# -- advantages -----------------------------------------------------------------------


@pytest.mark.parametrize("levels", [0, 2])  # continuous rewards; 0/1 rewards with ties and constant groups
@pytest.mark.parametrize("by_std", [True, False])
def test_grpo_and_dr_grpo_advantages(levels, by_std):
    """migrating.md verl `algorithm.adv_estimator`, `norm_adv_by_std_in_grpo`."""
    batch = random_batch(1, reward_levels=levels)
    theirs, _ = core.compute_grpo_outcome_advantage(batch.last_token_rewards(), batch.mask, group_ids(batch),
                                                    norm_adv_by_std_in_grpo=by_std)
    ours = compute_advantages(batch.groups, "grpo", "group" if by_std else "none")
    assert_values(theirs, batch.token_advantages(flat(ours)))


def test_rloo_advantages():
    batch = random_batch(2)
    theirs, _ = core.compute_rloo_outcome_advantage(batch.last_token_rewards(), batch.mask, group_ids(batch))
    assert_values(theirs, batch.token_advantages(flat(compute_advantages(batch.groups, "rloo", "none"))))


def test_reinforce_pp_baseline_whitens_over_tokens():
    """verl's masked_whiten divides by sqrt(var + 1e-8): advantage_eps = 0."""
    batch = random_batch(3)
    theirs, _ = core.compute_reinforce_plus_plus_baseline_outcome_advantage(batch.last_token_rewards(), batch.mask,
                                                                            group_ids(batch))
    ours = compute_advantages(batch.groups, "reinforce_pp_baseline", "batch_tokens", eps=0.0, tokens=batch.lengths)
    assert_values(theirs, batch.token_advantages(flat(ours)))
    per_sample = compute_advantages(batch.groups, "reinforce_pp_baseline", "batch")  # the estimator's default
    assert float((theirs - batch.token_advantages(flat(per_sample))).abs().max()) > 0.01


def test_reinforce_pp_whitens_over_tokens():
    batch = random_batch(4)
    theirs, _ = core.compute_reinforce_plus_plus_outcome_advantage(batch.last_token_rewards(), batch.mask,
                                                                   config=algo.AlgoConfig(gamma=1.0))
    ours = compute_advantages(batch.groups, "reinforce_pp", "batch_tokens", eps=0.0, tokens=batch.lengths)
    assert_values(theirs, batch.token_advantages(flat(ours)))


# -- the clipped loss, the KL term, GSPO ----------------------------------------------------


def verl_loss(batch, config, kl_type=None, kl_coef=0.0, old=None, weights=None, mask=None, policy="vanilla"):
    """verl's actor loss of one micro-batch as its worker adds it up: the policy
    loss, plus ``kl_coef`` times the aggregated ``kl_penalty``."""
    mask = batch.mask if mask is None else mask
    old = batch.behaviour if old is None else old

    def loss_of(logprobs):
        loss, _ = core.get_policy_loss_fn(policy)(old_log_prob=old, log_prob=logprobs,
                                                  advantages=batch.token_advantages(), response_mask=mask,
                                                  loss_agg_mode=config.loss_agg_mode, config=config,
                                                  rollout_is_weights=weights)
        if kl_type is not None:
            kld = core.kl_penalty(logprob=logprobs, ref_logprob=batch.ref, kl_penalty=kl_type)
            loss = loss + kl_coef * core.agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=config.loss_agg_mode)
        return loss

    return loss_of


@pytest.mark.parametrize("agg", AGGS)
def test_clipped_loss_with_dual_clip(agg):
    """migrating.md verl `clip_ratio*`, `clip_ratio_c`, `loss_agg_mode`."""
    batch = random_batch(5, empty_rows=1)
    theirs = value_and_grad(verl_loss(batch, actor_config(agg=agg)), batch)
    ours = value_and_grad(rldsl_loss(batch, PolicyLossConfig(clip=0.2, clip_high=0.28, dual_clip=3.0,
                                                             agg=AGGS[agg])), batch)
    assert_same(theirs, ours)


def test_the_constant_length_norm_is_seq_mean_token_sum_norm():
    batch = random_batch(6)
    theirs = value_and_grad(verl_loss(batch, actor_config(agg="seq-mean-token-sum-norm", loss_scale_factor=7)), batch)
    ours = value_and_grad(rldsl_loss(batch, PolicyLossConfig(clip_high=0.28, dual_clip=3.0, agg="seq_mean_token_sum",
                                                             length_norm=7)), batch)
    assert_same(theirs, ours)


@pytest.mark.parametrize(("kl_type", "estimator", "clamps"), [
    ("low_var_kl", "k3", LOW_VAR_KL), ("k3", "k3", LOW_VAR_KL), ("k1", "k1", {}), ("k2", "k2", {})])
def test_kl_loss(kl_type, estimator, clamps):
    """migrating.md verl `kl_loss_type`, `kl_loss_coef`: low_var_kl bounds the log-ratio to +-20, then the
    estimate to +-10 (the batch puts a tenth of the reference 25 nats off)."""
    batch = random_batch(7)
    theirs = value_and_grad(verl_loss(batch, actor_config(), kl_type, kl_coef=0.5), batch)
    config = PolicyLossConfig(clip_high=0.28, dual_clip=3.0, kl=0.5, kl_estimator=estimator, **clamps)
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config), batch))
    if clamps:  # the translation's old plain k3: one token 25 nats below its reference costs e^25
        plain = PolicyLossConfig(clip_high=0.28, dual_clip=3.0, kl=0.5, kl_estimator=estimator)
        assert difference(theirs, value_and_grad(rldsl_loss(batch, plain), batch)) > 1.0


def test_the_issue_example_low_var_kl_at_its_clamp():
    """logp -5, ref -2: verl's low_var_kl is 10 with no gradient; a plain k3 is e^3 - 4 = 16.09."""
    from rldsl.runtime.engines.policy_loss import kl_estimate

    logp, ref = torch.tensor([-5.0], dtype=torch.float64, requires_grad=True), torch.tensor([-2.0], dtype=torch.float64)
    theirs = core.kl_penalty(logprob=logp, ref_logprob=ref, kl_penalty="low_var_kl")
    ours = kl_estimate(logp, ref, "k3", input_clamp=20.0, output_clamp=10.0)
    assert float(theirs.detach()) == float(ours.detach()) == 10.0
    assert float(kl_estimate(logp, ref, "k3").detach()) == pytest.approx(math.exp(3) - 4)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_gspo(agg):
    batch = random_batch(8, drift=0.1)
    theirs = value_and_grad(verl_loss(batch, actor_config(agg=agg), policy="gspo"), batch)
    ours = value_and_grad(rldsl_loss(batch, PolicyLossConfig(clip=0.2, clip_high=0.28, ratio="sequence",
                                                             agg=AGGS[agg])), batch)
    assert_same(theirs, ours)


# -- rollout corrections ---------------------------------------------------------------


def is_weights(batch, level, threshold):
    weights, _ = correction.compute_rollout_correction_weights(batch.proximal - batch.behaviour, batch.mask,
                                                               rollout_is=level, rollout_is_threshold=threshold)
    return weights


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_importance_sampling(level):
    """rollout_is = token | sequence with a threshold: correction = tis (verl's old_log_prob is the
    proximal policy, its rollout_log_probs the behaviour one)."""
    batch = random_batch(9, mismatch=0.3 if level == "sequence" else 0.5)
    theirs = value_and_grad(verl_loss(batch, actor_config(), old=batch.proximal,
                                      weights=is_weights(batch, level, 2.0)), batch)
    config = PolicyLossConfig(clip_high=0.28, dual_clip=3.0, correction="tis", correction_level=level,
                              correction_high=2.0)
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config), batch))


def test_icepop_keeps_rejected_tokens_in_the_mean():
    """rollout_is_threshold = "0.5_5.0" zeroes the weights outside, the mask (so the KL term) unchanged:
    correction = icepop with rejected = zero."""
    batch = random_batch(10, mismatch=0.8)
    theirs = value_and_grad(verl_loss(batch, actor_config(), "low_var_kl", 0.5, old=batch.proximal,
                                      weights=is_weights(batch, "token", "0.5_5.0")), batch)
    config = dict(clip_high=0.28, dual_clip=3.0, kl=0.5, **LOW_VAR_KL, correction="icepop")
    assert_same(theirs, value_and_grad(rldsl_loss(batch, PolicyLossConfig(**config, rejected="zero")), batch))
    assert difference(theirs, value_and_grad(rldsl_loss(batch, PolicyLossConfig(**config)), batch)) > 1e-3


@pytest.mark.parametrize(("option", "level"), [("token_k1", "token"), ("seq_sum_k1", "sequence")])
def test_rejection_sampling_removes_rejected_tokens_from_the_mask(option, level):
    """rollout_rs = *_k1 with "l_u" keeps log(pi_rollout / pi_old) in [log l, log u], that is the weight
    w = pi_old / pi_rollout in [1/u, 1/l]; the rejected leave the mask. With the IS weights on top
    (threshold 1/l: no truncation inside), it is correction = mis with [1/u, 1/l], rejected = unmask."""
    low, high = 0.4, 1.25
    batch = random_batch(11, mismatch=0.4 if level == "token" else 0.15)
    kept, _ = correction.compute_rollout_rejection_mask(batch.proximal - batch.behaviour, batch.mask,
                                                        rollout_rs=option, rollout_rs_threshold=f"{low}_{high}")
    assert 0 < float(kept.sum()) < float(batch.mask.sum())  # some rejected, some kept
    theirs = value_and_grad(verl_loss(batch, actor_config(), "low_var_kl", 0.5, old=batch.proximal, mask=kept,
                                      weights=is_weights(batch, level, 1 / low) * kept), batch)
    exact = dict(clip_high=0.28, dual_clip=3.0, kl=0.5, **LOW_VAR_KL, correction="mis", correction_level=level,
                 correction_low=1 / high, correction_high=1 / low)
    assert_same(theirs, value_and_grad(rldsl_loss(batch, PolicyLossConfig(**exact, rejected="unmask")), batch))
    counted = value_and_grad(rldsl_loss(batch, PolicyLossConfig(**exact)), batch)  # rejected still counted
    inverse = value_and_grad(rldsl_loss(batch, PolicyLossConfig(**{**exact, "correction_low": low,
                                                                   "correction_high": high},
                                                                rejected="unmask")), batch)
    assert difference(theirs, counted) > 1e-3 and difference(theirs, inverse) > 1e-3


# -- the legacy worker's per-micro-batch token mean -----------------------------------------


def legacy_worker_loss(batch, micro_batches, kl_coef):
    """verl's dp_actor.update_policy at the translated commit (b178a3cd): each micro-batch's loss is
    agg_loss over its own tokens (no global batch info), scaled by 1 / gradient_accumulation."""
    config = actor_config(clip_high=0.2)

    def loss_of(logprobs):
        total = 0.0
        for rows in micro_batches:
            loss, _ = core.compute_policy_loss_vanilla(old_log_prob=batch.behaviour[rows], log_prob=logprobs[rows],
                                                       advantages=batch.token_advantages()[rows],
                                                       response_mask=batch.mask[rows], loss_agg_mode="token-mean",
                                                       config=config)
            kld = core.kl_penalty(logprob=logprobs[rows], ref_logprob=batch.ref[rows], kl_penalty="low_var_kl")
            kl_loss = core.agg_loss(loss_mat=kld, loss_mask=batch.mask[rows], loss_agg_mode="token-mean")
            total = total + (loss + kl_loss * kl_coef) / len(micro_batches)
        return total

    return loss_of


def test_each_micro_batch_token_mean_averaged():
    """migrating.md verl `loss_agg_mode` token-mean with `ppo_micro_batch_size_per_gpu`: agg = micro_token_mean."""
    batch = random_batch(12, rows=20)
    micro_batches = [list(range(start, start + 5)) for start in range(0, 20, 5)]
    theirs = value_and_grad(legacy_worker_loss(batch, micro_batches, kl_coef=0.5), batch)
    config = PolicyLossConfig(dual_clip=3.0, kl=0.5, agg="micro_token_mean", **LOW_VAR_KL)
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config, forwards=micro_batches), batch))
    step_mean = PolicyLossConfig(dual_clip=3.0, kl=0.5, **LOW_VAR_KL)
    assert difference(theirs, value_and_grad(rldsl_loss(batch, step_mean, forwards=micro_batches), batch)) > 1e-3


def test_the_verl_translation_is_the_recipe():
    """pipelines/from_verl_grpo_gsm8k.rlp's loss and advantages against verl configured as the recipe:
    GRPO by std, clip 0.2, clip_ratio_c 3, low_var_kl at 0.001 in the loss, token-mean per micro-batch of
    ppo_micro_batch_size_per_gpu = 32 rows of a rank's 160 (960 over dp 6). The fsdp engine forms the same
    forwards: micro_batch rows of the rank's mini-batch (tests/test_peer_settings.py)."""
    pipe = compile_file(ROOT / "pipelines" / "from_verl_grpo_gsm8k.rlp").plan.pipeline()
    train = pipe.stage("actor").settings
    config = PolicyLossConfig(**loss_options(train["loss"]))
    batch = random_batch(13, rows=160, group_size=5, reward_levels=2)
    advantages = flat(compute_advantages(batch.groups, train["advantage"], train["normalize"],
                                         train["advantage_eps"]))
    theirs, _ = core.compute_grpo_outcome_advantage(batch.last_token_rewards(), batch.mask, group_ids(batch))
    assert_values(theirs, batch.token_advantages(advantages))
    micro = train["micro_batch"]
    forwards = [list(range(start, start + micro)) for start in range(0, batch.rows, micro)]
    recipe = legacy_worker_loss(batch, forwards, kl_coef=0.001)
    assert_same(value_and_grad(recipe, batch), value_and_grad(rldsl_loss(batch, config, forwards), batch))
