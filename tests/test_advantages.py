"""Advantage estimators against numbers worked out by hand.

The rewards throughout: group A = [1, 0, 0, 1] (mean 0.5, unbiased std
sqrt(1/3)) and group B = [1, 1, 1, 0] (mean 0.75, unbiased std 0.5).
"""

import math

import pytest
import torch

from rldsl.runtime.control.advantages import (
    ESTIMATORS,
    NORMALISATIONS,
    batch_advantages,
    compute_advantages,
    default_normalisation,
    difficulty_masked,
    group_advantages,
    needs_tokens,
    needs_whole_batch,
)

REWARDS = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
ROOT3 = math.sqrt(3)
# REINFORCE++ whitening of the raw rewards: batch mean 5/8, unbiased std sqrt(1.875 / 7)
# (sum of squares 5 x 0.375^2 + 3 x 0.625^2 = 1.875)
WON, LOST = 0.375 / math.sqrt(1.875 / 7), -0.625 / math.sqrt(1.875 / 7)


def approx(expected):
    return [pytest.approx(group, abs=1e-5) for group in expected]


# (estimator, normalisation) -> advantages of REWARDS
BY_HAND = {
    # mean baseline, / group std: A (+-0.5) / sqrt(1/3); B (0.25, -0.75) / 0.5
    ("grpo", "group"): [[ROOT3 / 2, -ROOT3 / 2, -ROOT3 / 2, ROOT3 / 2], [0.5, 0.5, 0.5, -1.5]],
    # mean baseline over the batch: centred values have mean 0 and unbiased std sqrt(1.75 / 7) = 0.5
    ("grpo", "batch"): [[1.0, -1.0, -1.0, 1.0], [0.5, 0.5, 0.5, -1.5]],
    ("grpo", "none"): [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]],
    ("dr_grpo", "none"): [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]],
    ("dr_grpo", "group"): [[ROOT3 / 2, -ROOT3 / 2, -ROOT3 / 2, ROOT3 / 2], [0.5, 0.5, 0.5, -1.5]],
    # leave-one-out: A: 1 - 1/3, 0 - 2/3; B: 1 - 2/3, 0 - 3/3
    ("rloo", "none"): [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1 / 3, 1 / 3, 1 / 3, -1.0]],
    # rloo = n/(n-1) x (r - mean): the std scales alike, so group-normalised it is GRPO
    ("rloo", "group"): [[ROOT3 / 2, -ROOT3 / 2, -ROOT3 / 2, ROOT3 / 2], [0.5, 0.5, 0.5, -1.5]],
    # batch mean 0, sum of squares 28/9 over 7: std 2/3
    ("rloo", "batch"): [[1.0, -1.0, -1.0, 1.0], [0.5, 0.5, 0.5, -1.5]],
    # no baseline: whitened raw rewards
    ("reinforce_pp", "batch"): [[WON, LOST, LOST, WON], [WON, WON, WON, LOST]],
    ("reinforce_pp", "none"): REWARDS,
    # no centring: A / sqrt(1/3), B / 0.5
    ("reinforce_pp", "group"): [[ROOT3, 0.0, 0.0, ROOT3], [2.0, 2.0, 2.0, 0.0]],
    ("reinforce_pp_baseline", "batch"): [[1.0, -1.0, -1.0, 1.0], [0.5, 0.5, 0.5, -1.5]],
    ("reinforce_pp_baseline", "group"): [[ROOT3 / 2, -ROOT3 / 2, -ROOT3 / 2, ROOT3 / 2], [0.5, 0.5, 0.5, -1.5]],
    ("reinforce_pp_baseline", "none"): [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]],
}


def test_the_reinforce_pp_whitening_in_decimals():
    assert (WON, LOST) == pytest.approx((0.724569, -1.207615), abs=1e-6)


@pytest.mark.parametrize(("estimator", "normalize"), sorted(BY_HAND))
def test_every_estimator_and_normalisation_by_hand(estimator, normalize):
    assert compute_advantages(REWARDS, estimator, normalize) == approx(BY_HAND[(estimator, normalize)])


def test_the_defaults_of_each_estimator():
    assert {e: default_normalisation(e) for e in ESTIMATORS} == {
        "grpo": "group", "dr_grpo": "none", "rloo": "none", "reinforce_pp": "batch", "reinforce_pp_baseline": "batch"}
    assert [n for n in NORMALISATIONS if needs_whole_batch(n)] == \
        ["batch", "group_batch", "batch_tokens", "group_batch_tokens", "batch_std"]
    assert [n for n in NORMALISATIONS if needs_tokens(n)] == ["batch_tokens", "group_batch_tokens"]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
@pytest.mark.parametrize("normalize", NORMALISATIONS)
def test_group_baselines_give_exact_zeros_without_signal(estimator, normalize):
    tokens = [[3, 1, 2], [5, 4]] if needs_tokens(normalize) else None
    assert compute_advantages([[1.0, 1.0, 1.0], [0.0, 0.0]], estimator, normalize, tokens=tokens) == \
        [[0.0] * 3, [0.0] * 2]
    one = [[7]] if needs_tokens(normalize) else None
    assert compute_advantages([[0.7]], estimator, normalize, tokens=one) == [[0.0]]  # one sample: nothing to compare


def test_a_zero_variance_group_or_batch_becomes_zeros_when_scaled():
    assert compute_advantages([[1.0, 1.0], [1.0, 1.0]], "reinforce_pp", "batch") == [[0.0, 0.0], [0.0, 0.0]]
    assert compute_advantages([[1.0, 1.0], [1.0, 0.0]], "reinforce_pp", "group")[0] == [0.0, 0.0]
    assert compute_advantages([[1.0, 1.0]], "reinforce_pp", "none") == [[1.0, 1.0]]


def test_group_normalisation_leaves_groups_independent_and_batch_does_not():
    alone = compute_advantages([REWARDS[0]], "grpo", "group")
    assert compute_advantages(REWARDS, "grpo", "group")[0] == alone[0]
    assert compute_advantages(REWARDS, "reinforce_pp", "batch")[0] != \
        compute_advantages([REWARDS[0]], "reinforce_pp", "batch")[0]


def test_eps_keeps_the_scale_finite():
    (tiny,) = compute_advantages([[0.0, 1e-9]], "grpo", "group", eps=1e-6)
    assert all(abs(a) < 1e-3 for a in tiny)


def test_the_grpo_helpers_agree_with_compute_advantages():
    assert group_advantages(REWARDS[1]) == compute_advantages([REWARDS[1]], "grpo", "group")[0]
    flat = torch.tensor([r for group in REWARDS for r in group])
    assert batch_advantages(flat, 4).tolist() == pytest.approx(sum(BY_HAND[("grpo", "group")], []), abs=1e-5)
    whitened = batch_advantages(flat, 4, estimator="reinforce_pp")  # its default: batch
    assert whitened.tolist() == pytest.approx(sum(BY_HAND[("reinforce_pp", "batch")], []), abs=1e-5)
    assert whitened.dtype == torch.float32


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="estimator 'ppo'"):
        compute_advantages(REWARDS, "ppo", "group")
    with pytest.raises(ValueError, match="normalisation 'std'"):
        compute_advantages(REWARDS, "grpo", "std")
    with pytest.raises(ValueError):
        default_normalisation("ppo")


def test_leave_one_out_std_by_hand():
    """Each sample over the std of the *other* three: in group A every sample's
    others are two of one reward and one of the other (std 1/sqrt(3)); in
    group B the last sample's others are all 1 (std 0: left unscaled)."""
    assert compute_advantages(REWARDS, "grpo", "leave_one_out") == approx(
        [[ROOT3 / 2, -ROOT3 / 2, -ROOT3 / 2, ROOT3 / 2], [0.25 * ROOT3, 0.25 * ROOT3, 0.25 * ROOT3, -0.75]])
    # NeMo RL's `use_leave_one_out_baseline` with `normalize_rewards`: rloo's baseline, the others' std
    assert compute_advantages(REWARDS, "rloo", "leave_one_out") == approx(
        [[2 / ROOT3, -2 / ROOT3, -2 / ROOT3, 2 / ROOT3], [1 / ROOT3, 1 / ROOT3, 1 / ROOT3, -1.0]])


def test_reward_clip_bounds_rewards_before_the_baseline():
    assert compute_advantages([[3.0, -4.0, 0.5]], "reinforce_pp", "none", reward_clip=1.0) == [[1.0, -1.0, 0.5]]
    # clipped first, so the group's mean is 1/6, not -1/6
    assert compute_advantages([[3.0, -4.0, 0.5]], "grpo", "none", reward_clip=1.0) == \
        approx([[5 / 6, -7 / 6, 1 / 3]])


def test_advantage_clip_bounds_advantages_after_the_scaling():
    # group B scaled by its std 0.5: [0.5, 0.5, 0.5, -1.5]
    assert compute_advantages(REWARDS, "grpo", "group", advantage_clip=1.0) == approx(
        [[ROOT3 / 2, -ROOT3 / 2, -ROOT3 / 2, ROOT3 / 2], [0.5, 0.5, 0.5, -1.0]])
    assert compute_advantages(REWARDS, "grpo", "group", advantage_clip=0.0)[1][3] == pytest.approx(-1.5, abs=1e-5)
    with pytest.raises(ValueError, match="advantage_clip"):
        compute_advantages(REWARDS, "grpo", "group", advantage_clip=-1.0)


def test_group_then_batch_whitening_by_hand():
    """grpo's group-scaled values (mean 0 over the batch, sum of squares 6 over 7) whitened: / sqrt(6/7)."""
    scale = math.sqrt(6 / 7)
    expected = [[v / scale for v in group] for group in BY_HAND[("grpo", "group")]]
    assert compute_advantages(REWARDS, "grpo", "group_batch") == approx(expected)
    assert needs_whole_batch("group_batch") and not needs_whole_batch("group")


def test_token_weighted_whitening_by_hand():
    """ROLL's `whiten_advantages`: every trained token carries its sample's
    value. Rewards [1, 0] over 3 and 1 tokens, [0, 1] over 0 and 4 (the 0-token
    sample is masked out of the loss and of the statistics): the 8 tokens hold
    7 ones and 1 zero, mean 7/8, unbiased variance (7 x (1/8)^2 + (7/8)^2) / 7 = 1/8."""
    std = math.sqrt(1 / 8)
    whitened = compute_advantages([[1.0, 0.0], [0.0, 1.0]], "reinforce_pp", "batch_tokens",
                                  tokens=[[3, 1], [0, 4]])
    assert whitened == approx([[(1 / 8) / std, (-7 / 8) / std], [(-7 / 8) / std, (1 / 8) / std]])
    assert whitened[0][0] == pytest.approx(0.353553, abs=1e-5)
    # equal lengths weigh every sample alike: the sample whitening up to the token count's Bessel correction
    by_samples = compute_advantages(REWARDS, "grpo", "batch")
    by_tokens = compute_advantages(REWARDS, "grpo", "batch_tokens", tokens=[[2] * 4, [2] * 4])
    correction = math.sqrt((16 - 1) / 16 * 8 / (8 - 1))
    assert by_tokens == approx([[v * correction for v in group] for group in by_samples])


def test_token_weighted_whitening_needs_the_token_counts():
    with pytest.raises(ValueError, match="batch_tokens"):
        compute_advantages(REWARDS, "grpo", "batch_tokens")
    with pytest.raises(ValueError, match="batch_tokens"):
        compute_advantages(REWARDS, "grpo", "batch_tokens", tokens=[[1, 2, 3, 4]])


def test_reward_bias_then_scale_then_clip_as_areal():
    """(r + bias) x scale, then the clip: 3 -> (3 - 0.5) x 10 = 25, clipped to 20;
    0 -> -5; 1 -> 5."""
    shaped = compute_advantages([[3.0, 0.0, 1.0]], "reinforce_pp", "none", reward_clip=20.0, reward_scale=10.0,
                                reward_bias=-0.5)
    assert shaped == [[20.0, -5.0, 5.0]]
    # the baseline comes after: the group mean of [20, -5, 5] is 20/3
    assert compute_advantages([[3.0, 0.0, 1.0]], "grpo", "none", reward_clip=20.0, reward_scale=10.0,
                              reward_bias=-0.5) == approx([[40 / 3, -35 / 3, -5 / 3]])
    # the defaults change nothing
    assert compute_advantages(REWARDS, "grpo", "group") == \
        compute_advantages(REWARDS, "grpo", "group", reward_scale=1.0, reward_bias=0.0)


@pytest.mark.parametrize(("rewards", "masked"), [
    ([0.0] * 8, True), ([1.0] * 8, True), ([1.0] * 7 + [0.0], False), ([1.0] + [0.0] * 7, False),
    ([1.0] * 19 + [0.0], True),  # mean 0.95: not strictly below the high bound
    ([1.0] * 2 + [0.0] * 18, True),  # mean 0.1: not strictly above the low bound
])
def test_difficulty_mask_keeps_the_groups_strictly_inside_the_bounds(rewards, masked):
    assert difficulty_masked(rewards, (0.1, 0.95)) is masked


def test_no_difficulty_mask_masks_nothing():
    assert not difficulty_masked([0.0, 0.0], None)


# -- the peers' variants (docs/migrating.md; tests/test_conformance_*.py checks them against the peers' code) --


def test_the_biased_std_divides_by_n():
    """REINFORCE++ whitening of the raw rewards with the biased std: 1.875 / 8, not / 7 (OpenRLHF)."""
    std = math.sqrt(1.875 / 8)
    assert compute_advantages(REWARDS, "reinforce_pp", "batch", std="biased", eps=0.0) == approx(
        [[0.375 / std, -0.625 / std, -0.625 / std, 0.375 / std], [0.375 / std] * 3 + [-0.625 / std]])
    with pytest.raises(ValueError, match="std 'n'"):
        compute_advantages(REWARDS, "grpo", "group", std="n")


def test_group_then_token_whitening_by_hand():
    """AReaL: the group-scaled values [+-sqrt(3)/2] and [0.5, 0.5, 0.5, -1.5], group A over 1 token
    each and group B over 3 each: 16 tokens, mean (0 + 3 x (1.5 - 1.5)) / 16 = 0, unbiased variance
    (4 x 3/4 + 3 x (3 x 0.25 + 2.25)) / 15 = 12 / 15."""
    std = math.sqrt(12 / 15)
    expected = [[v / std for v in group] for group in BY_HAND[("grpo", "group")]]
    assert compute_advantages(REWARDS, "grpo", "group_batch_tokens", tokens=[[1] * 4, [3] * 4], eps=0.0) == \
        approx(expected)


def test_the_batch_reward_std_scales_without_recentring():
    """TRL's scale_rewards = batch: the group-centred values over the std of all 8 rewards
    (5 ones, 3 zeros: unbiased variance (5 x (3/8)^2 + 3 x (5/8)^2) / 7 = 1.875 / 7)."""
    std = math.sqrt(1.875 / 7)
    expected = [[v / std for v in group] for group in BY_HAND[("grpo", "none")]]
    assert compute_advantages(REWARDS, "grpo", "batch_std", eps=0.0) == approx(expected)


def test_the_reward_clip_after_the_baseline():
    """OpenRLHF's clip_range bounds the centred (and group-scaled) values: [3, -4, 0.5] - mean -1/6."""
    assert compute_advantages([[3.0, -4.0, 0.5]], "grpo", "none", reward_clip=1.0,
                              reward_clip_at="after_baseline") == approx([[1.0, -1.0, 2 / 3]])
    assert compute_advantages(REWARDS, "grpo", "group", reward_clip=1.0, reward_clip_at="after_baseline") == \
        approx([[ROOT3 / 2, -ROOT3 / 2, -ROOT3 / 2, ROOT3 / 2], [0.5, 0.5, 0.5, -1.0]])
