"""The policy loss against numbers worked out by hand, for every option.

Two sequences of three tokens; the second has two real tokens. The inputs
are built so the importance ratios r = exp(logp - behaviour) and the
log-ratios to the reference d = logp - ref are round numbers:

    ratios r   [[1.0, 1.5, 0.5], [0.7, 4.0, pad]]    advantages A = [+1, -2]
    d          [[0.0, 0.5, -1.0], [0.2, 0.0, pad]]   clip 0.2: r kept in [0.8, 1.2]

Per-token loss max(-r A, -clip(r) A):
    sequence 1 (A = +1): -1.0 | -1.2 (1.5 clipped to 1.2) | -0.5   sum -2.7, mean -0.9
    sequence 2 (A = -2): +1.6 (0.7 clipped to 0.8) | +8.0           sum  9.6, mean  4.8
"""

import math

import pytest
import torch

from rldsl.runtime.engines.policy_loss import PolicyLossConfig, kl_estimate, policy_loss, rollout_metrics

LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [0.7, 4.0, 1.0]])
DELTA = torch.tensor([[0.0, 0.5, -1.0], [0.2, 0.0, 0.0]])
BEHAVIOUR = (LOGPROBS - torch.log(RATIOS)) * MASK
REFERENCE = (LOGPROBS - DELTA) * MASK
ADVANTAGES = torch.tensor([1.0, -2.0])


def loss(config: PolicyLossConfig, logprobs=LOGPROBS, behaviour=BEHAVIOUR, advantages=ADVANTAGES):
    return policy_loss(logprobs, behaviour, advantages, MASK, config, ref_logprobs=REFERENCE)


def gradient(config: PolicyLossConfig, behaviour=BEHAVIOUR) -> list[float]:
    """d loss_sum / d logprobs, row by row (6 values)."""
    logprobs = LOGPROBS.clone().requires_grad_(True)
    loss(config, logprobs, behaviour).loss_sum.backward()
    return logprobs.grad.flatten().tolist()


# -- aggregation --------------------------------------------------------------------


@pytest.mark.parametrize(("agg", "loss_sum", "count"), [
    ("token_mean", 6.9, 5),  # -2.7 + 9.6 over 5 tokens
    ("seq_mean_token_sum", 6.9, 2),  # the sequences' token sums, -2.7 + 9.6, over 2 sequences
    ("seq_mean_token_mean", 3.9, 2),  # the sequences' token means, -0.9 + 4.8, over 2 sequences
])
def test_each_aggregation(agg, loss_sum, count):
    out = loss(PolicyLossConfig(agg=agg))
    assert out.loss_sum.item() == pytest.approx(loss_sum, abs=1e-5)
    assert out.count == count
    assert out.stats["tokens"] == 5 and out.stats["sequences"] == 2
    assert out.stats["clipped_tokens"] == 2  # (1, 1.5) and (2, 0.7) took the clipped term
    assert out.stats["ratio_sum"] == pytest.approx(7.7, abs=1e-5)  # 1 + 1.5 + 0.5 + 0.7 + 4


def test_gradient_flows_only_through_unclipped_tokens():
    # d(-r A)/d logp = -r A where the unclipped term is taken: -1 * 1, -0.5 * 1, -4 * -2; 0 elsewhere.
    assert gradient(PolicyLossConfig()) == pytest.approx([-1.0, 0.0, -0.5, 0.0, 8.0, 0.0], abs=1e-5)


def test_a_sequence_without_tokens_counts_for_nothing():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    out = policy_loss(LOGPROBS, BEHAVIOUR * mask, ADVANTAGES, mask, PolicyLossConfig(agg="seq_mean_token_mean"))
    assert out.loss_sum.item() == pytest.approx(-0.9, abs=1e-5) and out.count == 1


# -- clipping -----------------------------------------------------------------------


def test_clip_high_widens_only_the_upper_side():
    # clip_high 0.6: r kept in [0.8, 1.6]; (1, 1.5) is no longer clipped: -1.5; (2, 0.7) still is.
    out = loss(PolicyLossConfig(clip_high=0.6))
    assert out.loss_sum.item() == pytest.approx(-1.0 - 1.5 - 0.5 + 1.6 + 8.0, abs=1e-5)  # 6.6
    assert out.stats["clipped_tokens"] == 1


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # c = 3: a token with A < 0 loses at most -A c = 6; (2, 4.0) had 8.0 -> 6.0, (2, 0.7) keeps 1.6.
    config = PolicyLossConfig(dual_clip=3.0)
    out = loss(config)
    assert out.loss_sum.item() == pytest.approx(-2.7 + 1.6 + 6.0, abs=1e-5)  # 4.9
    assert out.stats["dual_clipped_tokens"] == 1
    assert gradient(config) == pytest.approx([-1.0, 0.0, -0.5, 0.0, 0.0, 0.0], abs=1e-5)  # the cap is constant


# -- KL -----------------------------------------------------------------------------

K3 = [
    0.0,  # d = 0
    math.exp(-0.5) + 0.5 - 1,  # d = 0.5: 0.1065306597
    math.exp(1.0) - 1.0 - 1,  # d = -1: 0.7182818285
    math.exp(-0.2) + 0.2 - 1,  # d = 0.2: 0.0187307531
    0.0,  # d = 0
]


@pytest.mark.parametrize(("estimator", "kl_sum"), [
    ("k1", -0.3),  # d: 0 + 0.5 - 1 + 0.2 + 0
    ("k2", 0.645),  # d^2 / 2: 0 + 0.125 + 0.5 + 0.02 + 0
    ("k3", 0.8435432413),  # e^-d + d - 1, the sum of K3
])
def test_each_kl_estimator_in_the_loss(estimator, kl_sum):
    assert sum(K3) == pytest.approx(0.8435432413, abs=1e-9)
    out = loss(PolicyLossConfig(kl=0.1, kl_estimator=estimator))
    assert out.stats["kl_sum"] == pytest.approx(kl_sum, abs=1e-5)
    assert out.loss_sum.item() == pytest.approx(6.9 + 0.1 * kl_sum, abs=1e-5)


def test_kl_as_a_reward_penalty_becomes_per_token_returns():
    # On-policy (r = 1, nothing clipped), k1, kl = 0.5: penalty_t = -0.5 d_t
    #   sequence 1: [0, -0.25, +0.5] -> returns to the end [0.25, 0.25, 0.5] -> A_t = [1.25, 1.25, 1.5]
    #   sequence 2: [-0.1, 0]        -> returns            [-0.1, 0]        -> A_t = [-2.1, -2.0]
    # loss -A_t per token: -1.25 - 1.25 - 1.5 + 2.1 + 2.0 = 0.1 over 5 tokens.
    config = PolicyLossConfig(kl=0.5, kl_estimator="k1", kl_in="reward")
    out = loss(config, behaviour=LOGPROBS * MASK)
    assert out.loss_sum.item() == pytest.approx(0.1, abs=1e-5) and out.count == 5
    assert out.stats["kl_sum"] == pytest.approx(-0.3, abs=1e-5)  # k1 of behaviour vs reference
    # The KL adds no gradient of its own: d loss / d logp_t = -A_t.
    expected = [-1.25, -1.25, -1.5, 2.1, 2.0, 0.0]
    assert gradient(config, behaviour=LOGPROBS * MASK) == pytest.approx(expected, abs=1e-5)


def test_a_kl_needs_reference_logprobs():
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(LOGPROBS, BEHAVIOUR, ADVANTAGES, MASK, PolicyLossConfig(kl=0.1))
    assert kl_estimate(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0


# -- GSPO: the sequence ratio ---------------------------------------------------------

S1 = 0.75 ** (1 / 3)  # exp(mean(ln 1, ln 1.5, ln 0.5)) = 0.9085602964
S2 = 2.8**0.5  # exp(mean(ln 0.7, ln 4)) = 1.6733200531


def test_sequence_ratio_is_the_length_normalised_sequence_ratio():
    # Both inside the clip range for their advantage's sign: -s A on every token.
    #   sequence 1: -0.9085602964 x 3 tokens; sequence 2: +3.3466401062 x 2 tokens
    config = PolicyLossConfig(ratio="sequence")
    out = loss(config)
    assert out.loss_sum.item() == pytest.approx(3.9675993232, abs=1e-5)
    assert out.stats["ratio_sum"] == pytest.approx(3 * S1 + 2 * S2, abs=1e-5)  # 6.0723209954
    assert out.stats["clipped_tokens"] == 0
    # d/dlogp_t of (-3 s1) = -s1 on each of 3 tokens; of (4 s2) = 2 s2 on each of 2 tokens.
    assert gradient(config) == pytest.approx([-S1, -S1, -S1, 2 * S2, 2 * S2, 0.0], abs=1e-5)
    by_sequence = loss(PolicyLossConfig(ratio="sequence", agg="seq_mean_token_mean"))
    assert by_sequence.loss_sum.item() == pytest.approx(-S1 + 2 * S2, abs=1e-5)  # 2.4380798098


def test_sequence_ratio_is_clipped_per_sequence():
    # A = [-1, +2]: sequence 2's s = 1.673 > 1.2 with A > 0 -> clipped, -1.2 * 2 on both tokens.
    # 3 x 0.9085602964 - 2 x 2.4 = -2.0743191108
    out = loss(PolicyLossConfig(ratio="sequence"), advantages=torch.tensor([-1.0, 2.0]))
    assert out.loss_sum.item() == pytest.approx(-2.0743191108, abs=1e-5)
    assert out.stats["clipped_tokens"] == 2


# -- the decoupled objective: a capped behaviour weight ---------------------------------


def test_behaviour_cap_weights_tokens_and_masks_those_above_the_cap():
    # Ratio against the detached proximal policy: 1, never clipped. Weight w = r; cap 2 drops (2, 4.0).
    # loss -A w: -1 - 1.5 - 0.5 (sequence 1) + 1.4 (sequence 2, w 0.7) = -1.6; the dropped token still counts.
    config = PolicyLossConfig(behaviour_cap=2.0)
    out = loss(config)
    assert out.loss_sum.item() == pytest.approx(-1.6, abs=1e-5) and out.count == 5
    assert out.stats["capped_tokens"] == 1
    assert out.stats["ratio_sum"] == pytest.approx(5.0, abs=1e-5)
    assert gradient(config) == pytest.approx([-1.0, -1.5, -0.5, 1.4, 0.0, 0.0], abs=1e-5)


# -- configuration and metrics ---------------------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"agg": "token"}, "agg"), ({"clip": 1.5}, "clip"), ({"clip_high": -0.1}, "clip_high"),
    ({"dual_clip": 0.5}, "dual_clip"), ({"kl": -1.0}, "kl"), ({"kl_estimator": "k4"}, "kl_estimator"),
    ({"kl_in": "advantage"}, "kl_in"), ({"ratio": "batch"}, "ratio"), ({"behaviour_cap": 0.5}, "behaviour_cap"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**options)


def test_the_count_follows_the_aggregation():
    assert PolicyLossConfig().count_name == "tokens"
    assert PolicyLossConfig(agg="seq_mean_token_sum").count_name == "sequences"
    assert PolicyLossConfig(clip=0.2).upper_clip == 0.2 and PolicyLossConfig(clip_high=0.28).upper_clip == 0.28


def test_rollout_metrics_average_the_loss_over_optimizer_steps():
    steps = [{"loss": 1.0, "lr": 0.1}, {"loss": 2.0, "lr": 0.2}, {"loss": 6.0, "lr": 0.3}]
    assert rollout_metrics(steps) == {"loss": 3.0, "lr": 0.3, "optimizer_steps": 3.0}
