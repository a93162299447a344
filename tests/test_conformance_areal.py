"""rldsl against AReaL's own functions (areal 1.0.4, the release of the
translated commit 4aef98d8): ``utils.functional.ppo_actor_loss_fn`` with its
rejection sampling, and ``utils.data.Normalization`` as
``PPOActor._compute_advantages`` calls it (reward shaping, ``reward_norm``
on the rewards, ``adv_norm`` on the per-token advantages under the loss
mask). Value and gradient within 1e-5 in float64 (tests/peers.py)."""

from __future__ import annotations

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
    logging_kept,
    random_batch,
    rldsl_loss,
    value_and_grad,
)

functional, data, cli_args = import_peer("areal", "areal.utils.functional", "areal.utils.data", "areal.api.cli_args")


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """AReaL may reconfigure logging whenever it logs (tests/peers.py: ``logging_kept``)."""
    with logging_kept():
        yield
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def areal_loss(batch, eps_clip=0.4, eps_clip_higher=None, c_clip=None, cap=5.0, level="token"):
    """ppo_actor_loss_fn with the decoupled objective: proximal = the batch-start policy, old = the generator's;
    rejection sampling as the translated recipe's (ratio metric, token level, mask, upper ``cap``)."""
    rejection = cli_args.RejectionSamplingConfig(upper=cap) if cap else None

    def loss_of(logprobs):
        loss, _ = functional.ppo_actor_loss_fn(logprobs=logprobs, proximal_logprobs=batch.proximal,
                                               old_logprobs=batch.behaviour, advantages=batch.token_advantages(),
                                               eps_clip=eps_clip, loss_mask=batch.mask.bool(),
                                               eps_clip_higher=eps_clip_higher, c_clip=c_clip,
                                               rejection_sampling=rejection, importance_sampling_level=level)
        return loss

    return loss_of


@pytest.mark.parametrize(("clip_high", "dual_clip"), [(None, None), (0.28, 3.0)])
def test_decoupled_loss_with_rejection_sampling(clip_high, dual_clip):
    """migrating.md AReaL `actor.eps_clip`, `use_decoupled_loss`, `rejection_sampling` (upper 5): behaviour_cap;
    a rejected token stays in the token count."""
    batch = random_batch(41, mismatch=1.0)
    theirs = value_and_grad(areal_loss(batch, eps_clip_higher=clip_high, c_clip=dual_clip), batch)
    config = PolicyLossConfig(clip=0.4, clip_high=clip_high, dual_clip=dual_clip or 0.0, behaviour_cap=5.0)
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config), batch))


def test_gspo_ratio_over_the_kept_tokens():
    """importance_sampling_level = sequence after rejection sampling: the sequence ratio averages the tokens the
    rejection kept (rejected_in_ratio = false)."""
    batch = random_batch(42, drift=0.1, mismatch=1.0)
    theirs = value_and_grad(areal_loss(batch, level="sequence"), batch)
    exact = PolicyLossConfig(clip=0.4, ratio="sequence", behaviour_cap=5.0, rejected_in_ratio=False)
    assert_same(theirs, value_and_grad(rldsl_loss(batch, exact), batch))
    every_token = PolicyLossConfig(clip=0.4, ratio="sequence", behaviour_cap=5.0)
    assert difference(theirs, value_and_grad(rldsl_loss(batch, every_token), batch)) > 1e-4


def areal_advantages(batch, reward_bias=-0.5, reward_scaling=10.0, reward_clip=20.0):
    """PPOActor._compute_advantages' normalisations: the rewards shaped, clipped and normalised by group
    (reward_norm: mean group, std group), then, discount and GAE lambda 1 with no critic or KL, every loss
    token of a response carries its reward, whitened by adv_norm (mean batch, std batch) under the loss mask."""
    reward_norm = data.Normalization(cli_args.NormConfig(mean_level="group", std_level="group",
                                                         group_size=batch.group_size))
    adv_norm = data.Normalization(cli_args.NormConfig(mean_level="batch", std_level="batch"))
    score = torch.clip((batch.rewards + reward_bias) * reward_scaling, min=-reward_clip, max=reward_clip)
    return adv_norm(reward_norm(score)[:, None] * batch.mask, batch.mask)


@pytest.mark.parametrize("levels", [0, 2])
def test_reward_norm_by_group_then_adv_norm_over_tokens(levels):
    """migrating.md AReaL `reward_norm`, `adv_norm`, `reward_scaling`, `reward_bias`, `reward_clip`:
    normalize = group_batch_tokens with advantage_eps = 1e-5."""
    batch = random_batch(43, reward_levels=levels)
    theirs = areal_advantages(batch)
    ours = compute_advantages(batch.groups, "grpo", "group_batch_tokens", 1e-5, 20.0, reward_scale=10.0,
                              reward_bias=-0.5, tokens=batch.lengths)
    assert_values(theirs, batch.token_advantages(flat(ours)), batch.mask)
    per_sample = compute_advantages(batch.groups, "grpo", "group_batch", 1e-5, 20.0, reward_scale=10.0,
                                    reward_bias=-0.5)
    assert float((theirs - batch.token_advantages(flat(per_sample))).abs().max()) > 1e-3


def test_the_areal_translation_is_the_recipe():
    """pipelines/from_areal_gsm8k_grpo_megatron.rlp against AReaL configured as gsm8k_grpo_megatron.yaml."""
    pipe = compile_file(ROOT / "pipelines" / "from_areal_gsm8k_grpo_megatron.rlp").plan.pipeline()
    train = pipe.stage("actor").settings
    batch = random_batch(44, reward_levels=2, mismatch=1.0)
    ours = compute_advantages(batch.groups, train["advantage"], train["normalize"], train["advantage_eps"],
                              train["reward_clip"], reward_scale=train["reward_scale"],
                              reward_bias=train["reward_bias"], tokens=batch.lengths, std=train["advantage_std"])
    assert_values(areal_advantages(batch), batch.token_advantages(flat(ours)), batch.mask)
    config = PolicyLossConfig(**loss_options(train["loss"]))
    assert_same(value_and_grad(areal_loss(batch), batch), value_and_grad(rldsl_loss(batch, config), batch))
