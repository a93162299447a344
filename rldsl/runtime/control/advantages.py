"""Advantage estimators: a baseline per sample, then a normalisation.

Each estimator subtracts its baseline from the rewards of one prompt group:

- ``grpo``, ``dr_grpo``, ``reinforce_pp_baseline``: the group's mean reward;
- ``rloo``: the mean reward of the group's *other* samples (leave-one-out);
- ``reinforce_pp``: nothing.

Then ``normalize`` scales them:

- ``group``: divided by the group's unbiased std + eps (GRPO);
- ``leave_one_out``: each divided by the unbiased std of the group's *other*
  samples + eps, left unscaled where that std is 0 (NeMo RL's
  ``normalize_rewards`` with ``use_leave_one_out_baseline``);
- ``batch``: whitened over every sample of the rollout batch (REINFORCE++);
- ``group_batch``: ``group``, then whitened over the rollout batch (AReaL's
  ``reward_norm`` by group with ``adv_norm`` over the batch);
- ``batch_tokens``: whitened over every trained token of the rollout batch:
  each sample's value counts once per token it trains, so the mean and the
  std weigh long responses more (ROLL's ``whiten_advantages``, verl's and
  OpenRLHF's REINFORCE++ whitening);
- ``group_batch_tokens``: ``group``, then ``batch_tokens`` (AReaL's
  ``reward_norm`` by group with ``adv_norm`` over the batch's tokens);
- ``batch_std``: divided by the std of the rollout batch's rewards, not
  re-centred (TRL's ``scale_rewards = "batch"``);
- ``none``: left as they are (Dr. GRPO, RLOO).

Every std is the unbiased one unless ``std = "biased"`` (OpenRLHF's
whitening), and a value is divided by ``std + eps``. Before the baseline
each reward becomes ``(reward + reward_bias) x reward_scale`` and is then
bounded to [-c, c] by ``reward_clip`` (AReaL's order; 0: no clip); with
``reward_clip_at = "after_baseline"`` the bound applies after the baseline
and a group's scaling instead, before any batch whitening (OpenRLHF's
``--reward.clip_range``). ``advantage_clip`` bounds the advantages to
[-c, c] after the scaling (ROLL's ``advantage_clip``). ``difficulty_masked`` says which groups a difficulty
mask keeps out of the loss (ROLL's ``difficulty_mask``): the controller
leaves them out of the advantages and of every batch statistic.

Pure Python (no torch at import): the controller computes them.
"""

from __future__ import annotations

import math
from typing import Sequence

from rldsl.plan import ADVANTAGE_NORMALISATION, ADVANTAGE_STDS, NORMALISATIONS, REWARD_CLIP_PLACES

ESTIMATORS = tuple(ADVANTAGE_NORMALISATION)
WHOLE_BATCH = ("batch", "group_batch", "batch_tokens", "group_batch_tokens", "batch_std")
TOKEN_WEIGHTED = ("batch_tokens", "group_batch_tokens")  # need each sample's trained token count
STD_KINDS = ADVANTAGE_STDS


def default_normalisation(estimator: str) -> str:
    """How ``estimator`` scales its advantages unless the pipeline says otherwise."""
    _check(estimator, ESTIMATORS, "advantage estimator")
    return ADVANTAGE_NORMALISATION[estimator]


def needs_whole_batch(normalize: str) -> bool:
    """Whether advantages depend on the whole rollout batch, not one group:
    the controller then computes them once every group of the batch is in."""
    _check(normalize, NORMALISATIONS, "normalisation")
    return normalize in WHOLE_BATCH


def needs_tokens(normalize: str) -> bool:
    """Whether the normalisation weighs each sample by its trained tokens."""
    return normalize in TOKEN_WEIGHTED


def difficulty_masked(rewards: Sequence[float], bounds: Sequence[float] | None) -> bool:
    """Whether a difficulty mask ``(low, high)`` keeps this group out of the
    loss: its mean reward is not strictly between the bounds (ROLL's test).
    None: no mask."""
    if bounds is None or not rewards:
        return False
    low, high = bounds
    mean = math.fsum(rewards) / len(rewards)
    return not low < mean < high


def compute_advantages(groups: list[list[float]], estimator: str, normalize: str, eps: float = 1e-6,
                       reward_clip: float = 0.0, advantage_clip: float = 0.0, *, reward_scale: float = 1.0,
                       reward_bias: float = 0.0, tokens: list[list[int]] | None = None, std: str = "unbiased",
                       reward_clip_at: str = "before_baseline") -> list[list[float]]:
    """The advantages of each prompt group's rewards, in the same shape.

    With a whole-batch normalisation (``needs_whole_batch``), ``groups``
    must be the whole rollout batch: the statistics are taken over every
    sample passed. ``batch_tokens`` and ``group_batch_tokens`` need
    ``tokens``: each sample's trained tokens, in the shape of ``groups``.
    """
    _check(estimator, ESTIMATORS, "advantage estimator")
    _check(normalize, NORMALISATIONS, "normalisation")
    _check(std, STD_KINDS, "std")
    _check(reward_clip_at, REWARD_CLIP_PLACES, "reward_clip_at")
    if reward_clip < 0 or advantage_clip < 0:
        raise ValueError(f"reward_clip {reward_clip} and advantage_clip {advantage_clip} must be >= 0 (0: off)")
    if needs_tokens(normalize) and [len(g) for g in tokens or []] != [len(g) for g in groups]:
        raise ValueError(f"normalize = {normalize} needs each sample's trained token count, in the shape of the "
                         "rewards")
    biased = std == "biased"
    clip_before = reward_clip if reward_clip_at == "before_baseline" else 0.0
    shaped = [_clip([(r + reward_bias) * reward_scale for r in rewards], clip_before) for rewards in groups]
    centred = [_subtract_baseline(rewards, estimator) for rewards in shaped]
    scaled = _group_stage(shaped, centred, normalize, eps, biased)
    if reward_clip_at == "after_baseline":
        scaled = [_clip(values, reward_clip) for values in scaled]
    if normalize in ("batch", "group_batch"):
        scaled = _whiten_batch(scaled, eps, biased)
    elif normalize in TOKEN_WEIGHTED:
        scaled = _whiten_tokens(scaled, tokens, eps, biased)
    elif normalize == "batch_std":
        scaled = _scale_by_batch_std(shaped, scaled, eps, biased)
    return [_clip(values, advantage_clip) for values in scaled]


def _group_stage(shaped, centred, normalize: str, eps: float, biased: bool) -> list[list[float]]:
    """The per-group half of a normalisation: a group's std, or each sample's leave-one-out std."""
    if normalize in ("group", "group_batch", "group_batch_tokens"):
        return [_scale_by_std(values, eps, biased) for values in centred]
    if normalize == "leave_one_out":
        return [_scale_by_others_std(rewards, values, eps, biased) for rewards, values in zip(shaped, centred)]
    return centred


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO: (reward - mean) / (std + eps) over one prompt group.

    ``std`` is the unbiased (n - 1) estimate, as torch.std computes it. A
    group whose rewards are all equal (or that has a single sample) carries
    no learning signal and gets exact zeros, not noise divided by eps.
    """
    return _scale_by_std(_subtract_baseline(list(rewards), "grpo"), eps)


def batch_advantages(rewards, group_size: int, eps: float = 1e-6, estimator: str = "grpo",
                     normalize: str | None = None):
    """``compute_advantages`` over a float tensor of prompt-major rows, in
    groups of ``group_size`` (the whole tensor is the batch); returns a
    float32 tensor of the same length. Defaults: GRPO, group-normalised."""
    import torch

    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.double().view(-1, group_size).tolist()
    advantages = compute_advantages(groups, estimator, normalize or default_normalisation(estimator), eps)
    return torch.tensor([a for group in advantages for a in group], dtype=torch.float32)


def _check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}: expected one of {', '.join(allowed)}")


def _subtract_baseline(rewards: list[float], estimator: str) -> list[float]:
    n = len(rewards)
    if estimator == "reinforce_pp" or n == 0:
        return [float(r) for r in rewards]
    if estimator == "rloo":
        if n == 1:  # no other sample to compare with: no signal
            return [0.0]
        total = math.fsum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
    mean = math.fsum(rewards) / n
    return [r - mean for r in rewards]


def _clip(values: list[float], bound: float) -> list[float]:
    """``values`` bounded to [-bound, bound]; a bound of 0 is off."""
    if not bound:
        return [float(v) for v in values]
    return [min(max(float(v), -bound), bound) for v in values]


def _std(values: list[float], biased: bool = False) -> float:
    """The unbiased (n - 1) std, as torch.std; or the biased (n) one."""
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - (0 if biased else 1)))


def _constant(values: list[float]) -> bool:
    """Too few or all-equal values: their std is no scale, so they become zeros."""
    return len(values) < 2 or all(v == values[0] for v in values)


def _scale_by_std(values: list[float], eps: float, biased: bool = False) -> list[float]:
    if _constant(values):
        return [0.0] * len(values)
    std = _std(values, biased)
    return [v / (std + eps) for v in values]


def _scale_by_others_std(rewards: list[float], values: list[float], eps: float, biased: bool = False) -> list[float]:
    """Each value over the unbiased std of the *other* rewards of its group
    (+ eps); where the others have no spread (fewer than two, or all equal)
    the value stays as it is, as NeMo RL leaves a zero std unscaled."""
    out = []
    for index, value in enumerate(values):
        others = rewards[:index] + rewards[index + 1:]
        out.append(value if _constant(others) else value / (_std(others, biased) + eps))
    return out


def _whiten_batch(groups: list[list[float]], eps: float, biased: bool = False) -> list[list[float]]:
    flat = [v for values in groups for v in values]
    if _constant(flat):
        return [[0.0] * len(values) for values in groups]
    mean, std = math.fsum(flat) / len(flat), _std(flat, biased)
    return [[(v - mean) / (std + eps) for v in values] for values in groups]


def _scale_by_batch_std(shaped: list[list[float]], groups: list[list[float]], eps: float,
                        biased: bool = False) -> list[list[float]]:
    """Each value over the std of the whole batch's rewards, not re-centred
    (TRL divides its group-centred advantages so with ``scale_rewards = "batch"``)."""
    flat = [r for rewards in shaped for r in rewards]
    if _constant(flat):  # equal rewards: every centred value is 0 already
        return [[0.0] * len(values) for values in groups]
    std = _std(flat, biased)
    return [[v / (std + eps) for v in values] for values in groups]


def _whiten_tokens(groups: list[list[float]], tokens: list[list[int]], eps: float,
                   biased: bool = False) -> list[list[float]]:
    """Whitened with the mean and std of the batch's trained tokens, each
    token carrying its sample's value (ROLL's and verl's ``masked_whiten``,
    OpenRLHF's biased one, AReaL's ``adv_norm``, over per-token advantages
    that are constant along a response)."""
    pairs = [(v, n) for values, counts in zip(groups, tokens) for v, n in zip(values, counts) if n > 0]
    total = sum(n for _, n in pairs)
    if total < 2 or _constant([v for v, _ in pairs]):
        return [[0.0] * len(values) for values in groups]
    mean = math.fsum(v * n for v, n in pairs) / total
    std = math.sqrt(math.fsum(n * (v - mean) ** 2 for v, n in pairs) / (total - (0 if biased else 1)))
    return [[(v - mean) / (std + eps) for v in values] for values in groups]
