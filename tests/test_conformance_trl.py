"""rldsl against TRL's GRPOTrainer (trl 1.16.0), value and gradient within
1e-5 in float64 (tests/peers.py), for the settings users bring: loss_type,
scale_rewards, mask_truncated_completions, beta (with and without
use_bias_correction_kl), epsilon / epsilon_high, importance_sampling_level
and the vLLM importance sampling modes.

TRL's loss lives in the trainer: ``GRPOTrainer._compute_loss`` runs here,
unchanged, on a trainer object holding only the attributes it reads, with
the model's forward replaced by the batch's logprobs and accelerate's
collectives by their one-process identities. Its advantages and vLLM
importance weights are computed inside ``_generate_and_score_completions``,
which needs a model and a generator; ``trl_advantages`` and
``trl_vllm_weights`` repeat those lines of trl 1.16.0 (marked where), with
TRL's own ``nanstd``."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rldsl.runtime.control.advantages import compute_advantages
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

grpo_trainer, trl_utils = import_peer("trl", "trl.trainer.grpo_trainer", "trl.trainer.utils")
WIDTH = 12  # max_completion_length of every batch here
LOSS_TYPES = {  # TRL's loss_type -> rldsl's loss arguments (with mask_truncated_completions: masked rows count)
    "grpo": {"agg": "seq_mean_token_mean", "count_masked": True},
    "bnpo": {"agg": "micro_token_mean"},
    "dr_grpo": {"agg": "seq_mean_token_sum", "length_norm": WIDTH, "count_masked": True},
    "dapo": {"agg": "token_mean"},
}


class OneProcess:
    """accelerate's Accelerator as ``_compute_loss`` calls it, on a single process."""

    num_processes, process_index, sync_gradients = 1, 0, True

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor, reduction="sum"):
        return tensor


def trainer(logprobs, loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=None, level="token",
            bias_corrected_kl=False, accumulation=1):
    """A GRPOTrainer holding what ``_compute_loss`` reads (set as GRPOTrainer.__init__ sets it from
    GRPOConfig); its model's logprobs are ``logprobs``."""
    self = grpo_trainer.GRPOTrainer.__new__(grpo_trainer.GRPOTrainer)
    self.args = SimpleNamespace(use_bias_correction_kl=bias_corrected_kl, delta=None,
                                steps_per_generation=accumulation)
    self.loss_type, self.beta, self.importance_sampling_level = loss_type, beta, level
    self.epsilon_low, self.epsilon_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, None
    self.use_vllm, self.vllm_importance_sampling_correction = True, True
    self.max_completion_length, self.current_gradient_accumulation_steps = WIDTH, accumulation
    self.aux_loss_enabled, self._entropy_bonus_enabled = False, False
    self.model, self.accelerator = SimpleNamespace(training=True), OneProcess()
    self._metrics = defaultdict(lambda: defaultdict(list))
    self._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logprobs, torch.zeros_like(logprobs), None)
    return self


def trl_loss(batch, micro_batches=None, vllm_weights=None, advantages=None, **settings):
    """The sum of ``_compute_loss`` over the micro-batches of one optimizer step (TRL's gradient
    accumulation); the rollout batch is one generation batch."""
    micro_batches = micro_batches or [list(range(batch.rows))]
    advantages = batch.advantages if advantages is None else advantages

    def loss_of(logprobs):
        total = 0.0
        for rows in micro_batches:
            inputs = {"prompt_ids": torch.zeros(len(rows), 1, dtype=torch.long),
                      "prompt_mask": torch.ones(len(rows), 1, dtype=torch.long),
                      "completion_ids": torch.zeros(len(rows), WIDTH, dtype=torch.long),
                      "completion_mask": batch.mask[rows], "advantages": advantages[rows],
                      "old_per_token_logps": batch.proximal[rows], "ref_per_token_logps": batch.ref[rows],
                      "num_items_in_batch": batch.mask.sum(),
                      "importance_sampling_ratio": torch.ones(len(rows), 1, dtype=torch.float64)
                      if vllm_weights is None else vllm_weights[rows]}
            model = trainer(logprobs[rows], accumulation=len(micro_batches), **settings)
            total = total + model._compute_loss(None, inputs)
        return total

    return loss_of


def on_policy_of(batch):
    """With no vLLM correction TRL weighs nothing: rldsl's generator logprobs are then the proximal ones."""
    return {"behaviour": batch.proximal}


# -- the loss types ---------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("masked", [0, 2])  # mask_truncated_completions: rows with no trained token
def test_each_loss_type(loss_type, masked):
    batch = random_batch(21, empty_rows=masked, far_ref=0)
    micro_batches = [list(range(8)), list(range(8, 16))]  # gradient accumulation over two micro-batches
    theirs = value_and_grad(trl_loss(batch, micro_batches, loss_type=loss_type, epsilon_high=0.28), batch)
    config = PolicyLossConfig(clip=0.2, clip_high=0.28, **LOSS_TYPES[loss_type])
    ours = value_and_grad(rldsl_loss(batch, config, forwards=micro_batches, **on_policy_of(batch)), batch)
    assert_same(theirs, ours)


def test_dr_grpo_divides_by_max_completion_length():
    batch = random_batch(22, far_ref=0)
    theirs = value_and_grad(trl_loss(batch, loss_type="dr_grpo"), batch)
    unscaled = PolicyLossConfig(agg="seq_mean_token_sum")  # Dr. GRPO's sum per sequence, without TRL's constant
    ours = value_and_grad(rldsl_loss(batch, unscaled, **on_policy_of(batch)), batch)
    assert ours[0] == pytest.approx(theirs[0] * WIDTH, abs=1e-9)


def test_masked_completions_count_in_the_grpo_mean():
    batch = random_batch(23, empty_rows=3, far_ref=0)
    theirs = value_and_grad(trl_loss(batch, loss_type="grpo"), batch)
    kept_out = PolicyLossConfig(agg="seq_mean_token_mean")  # rldsl's sequence mean: rows with tokens only
    ours = value_and_grad(rldsl_loss(batch, kept_out, **on_policy_of(batch)), batch)
    assert ours[0] == pytest.approx(theirs[0] * 16 / 13, abs=1e-9)


@pytest.mark.parametrize("bias_corrected", [False, True])
def test_beta_adds_k3_to_the_loss(bias_corrected):
    """beta: k3 of the reference in the loss; use_bias_correction_kl (TRL's default) weighs it by the ratio."""
    batch = random_batch(24, far_ref=0)
    theirs = value_and_grad(trl_loss(batch, beta=0.04, bias_corrected_kl=bias_corrected), batch)
    config = PolicyLossConfig(kl=0.04, kl_estimator="k3", kl_weighted=bias_corrected)
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config, **on_policy_of(batch)), batch))
    if bias_corrected:
        unweighted = PolicyLossConfig(kl=0.04, kl_estimator="k3")
        assert difference(theirs, value_and_grad(rldsl_loss(batch, unweighted, **on_policy_of(batch)), batch)) > 1e-3


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_epsilon_high_and_the_sequence_ratio(level):
    """epsilon / epsilon_high: clip / clip_high; importance_sampling_level = sequence: ratio = sequence (GSPO)."""
    batch = random_batch(25, drift=0.1 if level == "sequence" else 0.3, far_ref=0)
    theirs = value_and_grad(trl_loss(batch, loss_type="grpo", epsilon=0.2, epsilon_high=0.28, level=level), batch)
    config = PolicyLossConfig(clip=0.2, clip_high=0.28, ratio=level, agg="seq_mean_token_mean", count_masked=True)
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config, **on_policy_of(batch)), batch))


# -- the vLLM importance sampling correction ---------------------------------------------------


def trl_vllm_weights(batch, mode, clip_min, clip_max):
    """The importance_sampling_ratio of trl 1.16.0's _generate_and_score_completions (grpo_trainer.py, "Compute
    the importance sampling ratio when using vLLM"), repeated: exp(old - sampling) per token, or of its sum over
    the response; truncated to [clip_min, clip_max] or zeroed outside it."""
    diff = (batch.proximal - batch.behaviour) * batch.mask
    log_ratio = diff.sum(dim=-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)


@pytest.mark.parametrize(("mode", "correction"), [("token_truncate", "tis"), ("token_mask", "mis"),
                                                  ("sequence_truncate", "tis"), ("sequence_mask", "mis")])
@pytest.mark.parametrize("clip_min", [None, 0.5])
def test_vllm_importance_sampling_modes(mode, correction, clip_min):
    """vllm_importance_sampling_mode with clip_min / clip_max (default None, 3.0): correction and its bounds at
    the matching level; a masked token keeps its KL term and its count (rejected = zero): TRL multiplies the
    policy term by 0."""
    level = mode.split("_")[0]
    batch = random_batch(26, mismatch=0.5 if level == "token" else 0.2, far_ref=0)
    weights = trl_vllm_weights(batch, mode, clip_min, 3.0)
    theirs = value_and_grad(trl_loss(batch, vllm_weights=weights, beta=0.04, epsilon_high=0.28), batch)
    bounds = {"correction_high": 3.0, **({"correction_low": clip_min} if clip_min else {})}
    config = PolicyLossConfig(clip_high=0.28, kl=0.04, correction=correction, correction_level=level, **bounds,
                              rejected="zero")
    assert_same(theirs, value_and_grad(rldsl_loss(batch, config), batch))


# -- advantages --------------------------------------------------------------------------


def trl_advantages(rewards, group_size, scale_rewards):
    """The advantages of trl 1.16.0's _generate_and_score_completions (grpo_trainer.py,
    multi_objective_aggregation = "sum_then_normalize"), repeated with TRL's own nanstd."""
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size, dim=0)
    if scale_rewards in ("group", "none"):
        std = trl_utils.nanstd(grouped, dim=1).repeat_interleave(group_size, dim=0)
    else:
        std = trl_utils.nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return advantages


@pytest.mark.parametrize(("scale_rewards", "normalize"), [("group", "group"), ("batch", "batch_std"),
                                                          ("none", "none")])
@pytest.mark.parametrize("levels", [0, 2])
def test_scale_rewards(scale_rewards, normalize, levels):
    """scale_rewards: normalize, with TRL's group std eps 1e-4 as advantage_eps."""
    batch = random_batch(27, reward_levels=levels)
    theirs = trl_advantages(batch.rewards, batch.group_size, scale_rewards)
    assert_values(theirs, flat(compute_advantages(batch.groups, "grpo", normalize, eps=1e-4)))
    if scale_rewards == "group" and not levels:  # rldsl's own eps, 1e-6, is off by up to 1e-4 / std
        assert float((theirs - flat(compute_advantages(batch.groups, "grpo", "group"))).abs().max()) > 1e-5
