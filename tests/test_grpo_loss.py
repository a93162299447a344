"""The GRPO loss against numbers worked out by hand."""

import math

import pytest
import torch

from rldsl.runtime.control.advantages import batch_advantages, group_advantages
from rldsl.runtime.engines.grpo_loss import GRPOLossConfig, grpo_loss, k3_kl

# Two sequences; the second has one real token.
LOGPROBS = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
BEHAVIOUR = torch.tensor([[-1.0, -2.5], [-0.2, 0.0]])
REFERENCE = torch.tensor([[-1.5, -2.0], [-0.5, 0.0]])
MASK = torch.tensor([[1, 1], [1, 0]])
ADVANTAGES = torch.tensor([1.0, -2.0])
# ratios: exp(0) = 1, exp(0.5) = 1.6487, exp(-0.3) = 0.7408
# token (0,0): A=+1, ratio 1      -> -min(1, 1)            = -1.0
# token (0,1): A=+1, ratio 1.6487 -> -min(1.6487, 1.2)     = -1.2
# token (1,0): A=-2, ratio 0.7408 -> -min(-1.4816, -1.6)   = +1.6
TOKEN_SUM = -1.0 - 1.2 + 1.6  # = -0.6 over 3 tokens
SEQUENCE_SUM = (-1.0 - 1.2) / 2 + 1.6  # = 0.5 over 2 sequences
K3_FIRST_TOKEN = math.exp(-0.5) + 0.5 - 1  # d = ref - logp = -0.5; the other tokens have d = 0


def test_token_level_matches_hand_computation():
    out = grpo_loss(LOGPROBS, BEHAVIOUR, ADVANTAGES, MASK, GRPOLossConfig(clip=0.2))
    assert out.loss_sum.item() == pytest.approx(TOKEN_SUM, abs=1e-6)
    assert out.count == 3
    assert out.loss_sum.item() / out.count == pytest.approx(-0.2, abs=1e-6)
    assert out.stats["clipped_tokens"] == 2
    assert out.stats["ratio_sum"] == pytest.approx(1 + math.exp(0.5) + math.exp(-0.3), abs=1e-6)


def test_sequence_level_matches_hand_computation():
    out = grpo_loss(LOGPROBS, BEHAVIOUR, ADVANTAGES, MASK, GRPOLossConfig(clip=0.2, level="sequence"))
    assert out.loss_sum.item() == pytest.approx(SEQUENCE_SUM, abs=1e-6)
    assert out.count == 2
    assert out.loss_sum.item() / out.count == pytest.approx(0.25, abs=1e-6)


def test_kl_term_adds_coefficient_times_k3():
    config = GRPOLossConfig(clip=0.2, kl=0.1)
    out = grpo_loss(LOGPROBS, BEHAVIOUR, ADVANTAGES, MASK, config, ref_logprobs=REFERENCE)
    assert out.loss_sum.item() == pytest.approx(TOKEN_SUM + 0.1 * K3_FIRST_TOKEN, abs=1e-6)
    assert out.stats["kl_sum"] == pytest.approx(K3_FIRST_TOKEN, abs=1e-6)
    assert k3_kl(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0


def test_gradient_flows_only_through_unclipped_tokens():
    logprobs = LOGPROBS.clone().requires_grad_(True)
    grpo_loss(logprobs, BEHAVIOUR, ADVANTAGES, MASK, GRPOLossConfig(clip=0.2)).loss_sum.backward()
    # d(-ratio * A)/d logp = -ratio * A on the unclipped token; clipped and masked tokens get 0.
    assert logprobs.grad.tolist() == [[-1.0, 0.0], [0.0, 0.0]]


def test_ratio_one_gives_plain_policy_gradient():
    out = grpo_loss(LOGPROBS, LOGPROBS, ADVANTAGES, MASK)
    assert out.loss_sum.item() == pytest.approx(-(1 + 1) + 2, abs=1e-6)
    assert out.stats["clipped_tokens"] == 0


def test_missing_reference_and_bad_config_raise():
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(LOGPROBS, BEHAVIOUR, ADVANTAGES, MASK, GRPOLossConfig(kl=0.1))
    with pytest.raises(ValueError, match="level"):
        GRPOLossConfig(level="batch")
    with pytest.raises(ValueError, match="clip"):
        GRPOLossConfig(clip=1.5)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # group 1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735; group 2: all equal -> 0
    expected = [0.5 / 0.57735027, -0.5 / 0.57735027, -0.5 / 0.57735027, 0.5 / 0.57735027] + [0.0] * 4
    assert batch_advantages(rewards, 4).tolist() == pytest.approx(expected, abs=1e-5)
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx(expected[:4], abs=1e-5)


def test_batch_advantages_reject_bad_groups():
    with pytest.raises(ValueError, match="groups of 3"):
        batch_advantages(torch.zeros(4), 3)
