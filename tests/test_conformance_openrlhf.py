"""rldsl against OpenRLHF's own functions (openrlhf 0.11.0, the release holding
the translated commit 3c3be623): ``models.loss.PolicyLoss`` and
``aggregate_loss``, ``models.utils.compute_approx_kl``, and the experience
maker's ``compute_advantages_and_returns``, on a ``RemoteExperienceMaker``
holding only the arguments it reads (its constructor wants Ray actors). Value and gradient within 1e-5 in float64
(tests/peers.py).

OpenRLHF imports ``flash_attn`` (a CUDA build) at module level; where it is
not installed the import sees an empty stand-in, never called
(``peers.stand_ins_unless_installed``)."""

from __future__ import annotations

from types import SimpleNamespace

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
    stand_ins_unless_installed,
    value_and_grad,
)

with stand_ins_unless_installed("flash_attn", "flash_attn.bert_padding", "flash_attn.utils",
                                "flash_attn.utils.distributed"):
    loss_module, utils, maker = import_peer("openrlhf", "openrlhf.models.loss", "openrlhf.models.utils",
                                            "openrlhf.trainer.ppo_utils.experience_maker")
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
KL_CLAMP = {"kl_output_clamp": 10.0}  # compute_approx_kl bounds every estimate to +-10


def openrlhf_loss(batch, policy_loss, kl_estimator=None, kl_coef=0.0, old=None, rollout=None):
    """PPOActor.training_step's loss: the policy loss, plus kl_coef times the aggregated
    compute_approx_kl (--algo.kl.use_loss), both over the micro-batch's tokens."""
    old = batch.behaviour if old is None else old

    def loss_of(logprobs):
        loss = policy_loss(logprobs, old, batch.token_advantages(), action_mask=batch.mask,
                           rollout_log_probs=rollout)[0]
        if kl_estimator is not None:
            kl = utils.compute_approx_kl(logprobs, batch.ref, kl_estimator=kl_estimator)
            loss = loss + kl_coef * loss_module.aggregate_loss(kl, batch.mask, token_level_loss=True)
        return loss

    return loss_of


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss(token_level, dual_clip):
    """migrating.md OpenRLHF `--actor.eps_clip_low_high`, `--actor.dual_clip`, token-level loss."""
    batch = random_batch(31, empty_rows=1)
    peer = loss_module.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.27, dual_clip=dual_clip,
                                  token_level_loss=token_level)
    theirs = value_and_grad(openrlhf_loss(batch, peer), batch)
    config = PolicyLossConfig(clip=0.2, clip_high=0.27, dual_clip=dual_clip or 0.0,
                              agg="token_mean" if token_level else "seq_mean_token_mean")
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config), batch))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_clamps_every_estimator(estimator):
    """migrating.md OpenRLHF `--algo.kl.estimator`, `--algo.kl.init_coef`: kl_output_clamp = 10."""
    batch = random_batch(32)
    peer = loss_module.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.27)
    theirs = value_and_grad(openrlhf_loss(batch, peer, estimator, kl_coef=0.5), batch)
    config = PolicyLossConfig(clip=0.2, clip_high=0.27, kl=0.5, kl_estimator=estimator, **KL_CLAMP)
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config), batch))
    unclamped = PolicyLossConfig(clip=0.2, clip_high=0.27, kl=0.5, kl_estimator=estimator)
    assert difference(theirs, value_and_grad(rldsl_loss(batch, unclamped), batch)) > 1e-3


@pytest.mark.parametrize(("kind", "correction", "rejected"), [("tis", "tis", "drop"), ("icepop", "icepop", "zero")])
def test_vllm_is_correction(kind, correction, rejected):
    """migrating.md OpenRLHF `--algo.advantage.is_correction_enable` (threshold [0.5, 5.0]): the weight
    p_old / p_vllm clamped (tis) or zeroed outside (icepop: its KL term stays)."""
    batch = random_batch(33, mismatch=0.8)
    peer = loss_module.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.27, enable_vllm_is_correction=True,
                                  vllm_is_truncated_threshold=[0.5, 5.0], vllm_is_correction_type=kind)
    theirs = value_and_grad(openrlhf_loss(batch, peer, "k3", 0.5, old=batch.proximal, rollout=batch.behaviour), batch)
    config = PolicyLossConfig(clip=0.2, clip_high=0.27, kl=0.5, **KL_CLAMP, correction=correction,
                              correction_low=0.5, correction_high=5.0, rejected=rejected)
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config), batch))


def test_gspo():
    batch = random_batch(34, drift=0.1)
    peer = loss_module.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.27, policy_loss_type="gspo")
    theirs = value_and_grad(openrlhf_loss(batch, peer), batch)
    config = PolicyLossConfig(clip=0.2, clip_high=0.27, ratio="sequence", agg="seq_mean_token_mean")
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config), batch))


# -- advantages: the experience maker --------------------------------------------------------


def openrlhf_advantages(batch, estimator, clip_range=(-10.0, 10.0), rewards=None):
    """ExperienceMaker.compute_advantages_and_returns on two experiences (the rollout batch split in two,
    as the maker's micro-batches), no KL in the reward; the per-token advantages, rows in batch order."""
    rewards = batch.rewards if rewards is None else rewards
    half = batch.rows // 2
    experiences = [maker.Experience(action_mask=batch.mask[rows].bool(), rewards=rewards[rows].clone(),
                                    kl=torch.zeros_like(batch.mask[rows]), index=list(rows), info={})
                   for rows in (range(half), range(half, batch.rows))]
    args = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=batch.group_size),
                           algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=1.0,
                                                                          no_std_norm=False)),
                           reward=SimpleNamespace(clip_range=clip_range))
    owner = maker.RemoteExperienceMaker.__new__(maker.RemoteExperienceMaker)  # no Ray actors: __init__ wants them
    owner.strategy, owner.args, owner.advantage_estimator = SimpleNamespace(args=args), args, estimator
    owner.kl_ctl = SimpleNamespace(value=0.0)
    owner.compute_advantages_and_returns(experiences)
    return torch.cat([experience.advantages for experience in experiences])


ESTIMATORS = {  # OpenRLHF's --algo.advantage.estimator -> rldsl's estimator, normalize and options
    "group_norm": ("grpo", "group", {"eps": 1e-9}),
    "dr_grpo": ("dr_grpo", "none", {}),
    "rloo": ("rloo", "none", {}),
    "reinforce_baseline": ("reinforce_pp_baseline", "batch_tokens", {"eps": 0.0, "std": "biased"}),
    "reinforce": ("reinforce_pp", "batch_tokens", {"eps": 0.0, "std": "biased"}),
}


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_advantages_with_the_reward_clip_after_the_baseline(estimator):
    """migrating.md OpenRLHF `--algo.advantage.estimator`, `--reward.clip_range`: rewards 15 x N(0, 1) so that
    the clip at 10 acts on centred values."""
    batch = random_batch(35)
    rewards = 15 * batch.rewards
    theirs = openrlhf_advantages(batch, estimator, rewards=rewards)
    ours_estimator, normalize, options = ESTIMATORS[estimator]

    def ours(place):
        return compute_advantages(rewards.view(-1, batch.group_size).tolist(), ours_estimator, normalize,
                                  reward_clip=10.0, reward_clip_at=place, tokens=batch.lengths, **options)

    assert_values(theirs, batch.token_advantages(flat(ours("after_baseline"))), batch.mask)
    if estimator in ("reinforce_baseline", "dr_grpo", "rloo"):  # centred values past 10: the place matters
        before = batch.token_advantages(flat(ours("before_baseline")))
        assert float((theirs - before).abs().max()) > 1e-3


def test_the_openrlhf_translation_is_the_recipe():
    """pipelines/from_openrlhf_grpo_dapo_hybrid.rlp against OpenRLHF configured as the script: group_norm,
    clip_range (-10, 10), eps_clip_low_high 0.2 0.27, k3 at 1e-3 in the loss, token-level loss."""
    pipe = compile_file(ROOT / "pipelines" / "from_openrlhf_grpo_dapo_hybrid.rlp").plan.pipeline()
    train = pipe.stage("actor").settings
    batch = random_batch(36, group_size=8)
    rewards = 30 * batch.rewards  # past the clip at 10: bounded before the baseline, the groups' spread shrinks
    theirs = openrlhf_advantages(batch, "group_norm", rewards=rewards)
    ours = compute_advantages(rewards.view(-1, 8).tolist(), train["advantage"], train["normalize"],
                              train["advantage_eps"], train["reward_clip"], reward_clip_at=train["reward_clip_at"],
                              std=train["advantage_std"])
    assert_values(theirs, batch.token_advantages(flat(ours)), batch.mask)
    peer = loss_module.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.27)
    theirs = value_and_grad(openrlhf_loss(batch, peer, "k3", 1e-3), batch)
    config = PolicyLossConfig(**loss_options(train["loss"]))
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config), batch))
