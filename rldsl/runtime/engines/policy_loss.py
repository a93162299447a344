"""The clipped policy-gradient loss family as a pure torch function.

One function covers GRPO / PPO's clipped surrogate and the variants real RL
frameworks use: DAPO's clip-higher (``clip_high``), dual clip for negative
advantages (``dual_clip``, verl's ``clip_ratio_c``), a KL to the reference
in the loss or as a per-token reward penalty (REINFORCE++), GSPO's
sequence-level ratio (``ratio = "sequence"``), AReaL's decoupled
objective with a capped behaviour importance weight (``behaviour_cap``) and
the rollout corrections of the generator/trainer mismatch (``correction``:
importance sampling untruncated, truncated or masked, per token or per
sequence, as NeMo RL's importance sampling correction, verl's
``rollout_correction`` and slime's TIS). The peers' variants (a mean per
forward, masked rows counted, what a rejected token keeps, a ratio-weighted
KL) are settings of ``loss_config.PolicyLossConfig``, checked against the
peers' code in tests/test_conformance_*.py.

With ``behaviour_cap`` or a correction, the clipped ratio is taken against
the proximal policy (the weights the rollout batch started with) and every
token is weighted by w = pi_prox / pi_behaviour. The proximal logprobs are
passed in when the trainer recomputed them at the batch start (several
optimizer steps per rollout batch); otherwise they are the trainer's own
logprobs detached, the same thing before the batch's first optimizer step.

The loss returns an UN-normalised sum plus the local count it is divided by
(``PolicyLossConfig.count_name``: tokens for ``agg = "token_mean"``,
sequences otherwise, or the loss's own count), so a split train step can
accumulate microbatches and divide once by the global count when it steps
the optimizer. Every statistic is a sum too, so microbatches and
data-parallel ranks add up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rldsl.runtime.engines.loss_config import (  # noqa: F401  (re-exported: the engines' and tests' names)
    AGGREGATIONS,
    CORRECTION_LEVELS,
    CORRECTIONS,
    DEFAULT_CORRECTION_BOUNDS,
    KL_ESTIMATORS,
    KL_PLACEMENTS,
    PER_FORWARD_AGGREGATIONS,
    RATIO_LEVELS,
    PolicyLossConfig,
)
from rldsl.runtime.engines.loss_terms import (
    aggregate,
    clipped_objective,
    correction_weights,
    kl_estimate,
    policy_ratio,
    token_advantages,
)
from rldsl.runtime.protocols import FIELD_VERSION

DEFAULT_CONFIG = PolicyLossConfig()
# Summable statistics of one microbatch, besides the loss sum. ``capped_tokens``: tokens whose weight a
# correction (or behaviour_cap) truncated or masked; ``mismatch_*``: generator vs proximal logprobs.
# ``engine_*``: the same over the tokens of rows generated with the very weights the trainer holds (the
# engines' numerical disagreement alone: engine_mismatch_stats).
STAT_NAMES = ("tokens", "sequences", "kl_sum", "clipped_tokens", "dual_clipped_tokens", "capped_tokens", "ratio_sum",
              "mismatch_kl_sum", "mismatch_k3_sum", "mismatch_ratio_sum", "engine_tokens", "engine_abs_diff_sum",
              "engine_k3_sum")
# ``loss_count``: the loss's own count, where it is not read off the masks (PolicyLossConfig.count_name).
STAT_NAMES += ("loss_count",)
# Per-token extremes: combined by max / min, not summed.
EXTREME_STATS = {"mismatch_ratio_max": max, "mismatch_ratio_min": min, "engine_abs_diff_max": max}


@dataclass
class LossSums:
    """A microbatch's contribution: ``loss_sum`` and the count it is divided by."""

    loss_sum: torch.Tensor  # differentiable scalar
    count: float
    stats: dict[str, float] = field(default_factory=dict)  # STAT_NAMES, sums over tokens / sequences


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig = DEFAULT_CONFIG,
    ref_logprobs: torch.Tensor | None = None,
    proximal_logprobs: torch.Tensor | None = None,
) -> LossSums:
    """The clipped policy-gradient loss (+ optional KL) summed over a microbatch.

    Shapes: logprobs / behaviour_logprobs / ref_logprobs / proximal_logprobs
    / mask [n, L], advantages [n] (one per sequence, broadcast over its
    tokens). ``proximal_logprobs``: the batch-start weights' logprobs (None:
    ``logprobs`` detached, exact before the batch's first optimizer step).
    """
    if config.kl > 0 and ref_logprobs is None:
        raise ValueError("the loss has a KL term but the batch has no ref_logprobs")
    mask = mask.to(logprobs.dtype)
    behaviour = behaviour_logprobs.to(logprobs.dtype)
    proximal = logprobs.detach() if proximal_logprobs is None else proximal_logprobs.to(logprobs.dtype)
    anchor = proximal if config.needs_proximal else behaviour
    weight, kept, corrected = correction_weights(proximal, behaviour, mask, config)
    unmasked = config.rejected == "unmask"
    ratio_mask = kept if unmasked or not config.rejected_in_ratio else mask
    ratio = policy_ratio((logprobs - anchor) * mask, ratio_mask, config.ratio)
    advantage = token_advantages(advantages.to(logprobs.dtype), behaviour, ref_logprobs, mask, config)
    per_token, clipped, dual_clipped = clipped_objective(ratio, advantage, config)
    per_token = per_token * weight
    kl = torch.zeros_like(per_token)
    if config.kl > 0:
        kl_from = logprobs if config.kl_in == "loss" else behaviour
        kl = kl_estimate(kl_from, ref_logprobs.to(logprobs.dtype), config.kl_estimator, **config.kl_clamps)
        if config.kl_in == "loss":
            per_token = per_token + config.kl * (kl * ratio if config.kl_weighted else kl)
    loss_sum, count = aggregate(per_token * (mask if config.rejected == "zero" else kept), kept if unmasked else mask,
                                config)
    stats = _stats(mask, kl, ratio, clipped, dual_clipped, corrected)
    stats.update(mismatch_stats(proximal, behaviour, mask), loss_count=count)
    return LossSums(loss_sum, count, stats)


@torch.no_grad()
def _stats(mask, kl, ratio, clipped, dual_clipped, corrected) -> dict[str, float]:
    tokens_per_sequence = mask.sum(dim=1)
    return {
        "tokens": float(tokens_per_sequence.sum()),
        "sequences": float((tokens_per_sequence > 0).sum()),
        "kl_sum": float((kl * mask).sum()),
        "clipped_tokens": _count_on(clipped, mask),
        "dual_clipped_tokens": _count_on(dual_clipped, mask),
        "capped_tokens": float(corrected.sum()),
        "ratio_sum": float((ratio * mask).sum()),
    }


@torch.no_grad()
def mismatch_stats(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the generator's logprobs are from the proximal policy's, over
    real tokens: sums of KL(behaviour || proximal) estimated by k1 = -d and
    k3 = e^d - 1 - d (d = log pi_prox - log pi_behaviour, sampled from the
    behaviour policy), of the ratio e^d, and its extremes."""
    on = mask > 0
    delta = (proximal - behaviour).float()[on]
    ratio = torch.exp(delta)
    empty = delta.numel() == 0
    return {
        "mismatch_kl_sum": float(-delta.sum()),
        "mismatch_k3_sum": float((ratio - 1 - delta).sum()),
        "mismatch_ratio_sum": float(ratio.sum()),
        "mismatch_ratio_max": float("-inf") if empty else float(ratio.max()),
        "mismatch_ratio_min": float("inf") if empty else float(ratio.min()),
    }


def merge_stats(total: dict[str, float], stats: dict[str, float]) -> None:
    """Add a microbatch's statistics into ``total``: sums add, extremes combine."""
    for name, value in stats.items():
        combine = EXTREME_STATS.get(name)
        if combine is None:
            total[name] = total.get(name, 0.0) + value
        else:
            total[name] = combine(total.get(name, value), value)


def no_stats() -> dict[str, float]:
    """The neutral element of ``merge_stats``: zero sums, empty extremes."""
    return {**dict.fromkeys(STAT_NAMES, 0.0), **{name: _EMPTY[combine] for name, combine in EXTREME_STATS.items()}}


_EMPTY = {max: float("-inf"), min: float("inf")}


def reduce_extremes(sums: dict[str, float], groups, device=None) -> dict[str, float]:
    """``sums``' extremes (EXTREME_STATS) combined over each process group of
    ``groups`` by one MAX (a minimum as the max of its negation)."""
    import torch.distributed as dist

    signs = [1.0 if combine is max else -1.0 for combine in EXTREME_STATS.values()]
    values = torch.tensor([sign * sums[name] for sign, name in zip(signs, EXTREME_STATS)], dtype=torch.float64,
                          device=device)
    for group in groups:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return {name: sign * value for sign, name, value in zip(signs, EXTREME_STATS, values.tolist())}


@torch.no_grad()
def engine_mismatch_stats(trainer: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                          same_weights: torch.Tensor) -> dict[str, float]:
    """The generator's and the trainer's logprobs of the same tokens under the
    same weights (rows ``same_weights`` [n]: generated with the version the
    trainer holds): sums of |d| and of KL(behaviour || trainer) by k3 =
    e^d - 1 - d (d = log pi_trainer - log pi_behaviour), and the largest |d|.
    Zero on exactly equal engines; anything else is numerics (kernels, dtype)
    or a sampler that is not the trainer's distribution."""
    on = (mask > 0) & same_weights.to(mask.device).bool()[:, None]
    delta = (trainer - behaviour).double()[on]
    return {"engine_tokens": float(delta.numel()), "engine_abs_diff_sum": float(delta.abs().sum()),
            "engine_k3_sum": float((torch.exp(delta) - 1 - delta).sum()),
            "engine_abs_diff_max": float(delta.abs().max()) if delta.numel() else float("-inf")}


def first_weights_mismatch(batch, logprobs: torch.Tensor, proximal: torch.Tensor | None, behaviour: torch.Tensor,
                           mask: torch.Tensor, version: int, stepped: bool) -> dict[str, float]:
    """engine_mismatch_stats where the trainer's logprobs are those of the
    step's first weights (the proximal ones, or the current ones before the
    step's first optimizer step: ``stepped`` False); {} elsewhere, or for a
    batch without the rows' versions."""
    if FIELD_VERSION not in batch or (proximal is None and stepped):
        return {}
    start = logprobs.detach() if proximal is None else proximal.to(logprobs.device)
    return engine_mismatch_stats(start, behaviour, mask, batch[FIELD_VERSION] == version)


def _count_on(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """How many real tokens have the flag set."""
    return float((flags.to(mask.dtype) * mask).sum())


def step_metrics(totals: dict[str, float], count: float, grad_norm, lr: float) -> dict[str, float]:
    """An optimizer step's metrics from the summed statistics of its
    microbatches (``count`` is the global token or sequence count the loss
    was divided by)."""
    tokens = max(totals["tokens"], 1.0)
    return {
        "loss": totals["loss_sum"] / count,
        "kl": totals["kl_sum"] / tokens,
        "clip_fraction": totals["clipped_tokens"] / tokens,
        "dual_clip_fraction": totals["dual_clipped_tokens"] / tokens,
        "capped_fraction": totals["capped_tokens"] / tokens,
        "mean_ratio": totals["ratio_sum"] / tokens,
        "tokens": totals["tokens"],
        "sequences": totals["sequences"],
        "grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
        "lr": lr,
        **_mismatch_metrics(totals, tokens),
    }


def _mismatch_metrics(totals: dict[str, float], tokens: float) -> dict[str, float]:
    """Means of the summed mismatch statistics, and the extremes an engine reduced (finite ones only)."""
    out = {name[:-len("_sum")]: totals[name] / tokens for name in ("mismatch_kl_sum", "mismatch_k3_sum")
           if name in totals}
    if "mismatch_ratio_sum" in totals:
        out["mismatch_ratio_mean"] = totals["mismatch_ratio_sum"] / tokens
    out.update({name: totals[name] for name in ("mismatch_ratio_max", "mismatch_ratio_min")
                if abs(totals.get(name, float("inf"))) < float("inf")})
    return {**out, **_engine_mismatch_metrics(totals)}


def _engine_mismatch_metrics(totals: dict[str, float]) -> dict[str, float]:
    """``mismatch/...``: the generator against the trainer on the same weights (engine_mismatch_stats)."""
    tokens = totals.get("engine_tokens", 0.0)
    if not tokens:
        return {}
    return {"mismatch/abs_diff_mean": totals["engine_abs_diff_sum"] / tokens,
            "mismatch/abs_diff_max": totals["engine_abs_diff_max"],
            "mismatch/kl": totals["engine_k3_sum"] / tokens, "mismatch/tokens": tokens}


def rollout_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """A rollout batch's metrics from its optimizer steps': the last step's,
    the number of steps and the mean loss over them."""
    return {**steps[-1], "optimizer_steps": float(len(steps)),
            "loss": sum(step["loss"] for step in steps) / len(steps), **_rollout_mismatch(steps)}


def _rollout_mismatch(steps: list[dict[str, float]]) -> dict[str, float]:
    """The mismatch over the whole rollout batch: the steps' means weighted
    by their tokens (each mini-batch holds other rows), extremes of them all."""
    measured = [step for step in steps if "mismatch_ratio_mean" in step]
    if not measured:
        return _rollout_engine_mismatch(steps)
    tokens = sum(step["tokens"] for step in measured) or 1.0
    out = {name: sum(step[name] * step["tokens"] for step in measured) / tokens
           for name in ("mismatch_kl", "mismatch_k3", "mismatch_ratio_mean", "capped_fraction") if name in measured[0]}
    for name, combine in EXTREME_STATS.items():
        values = [step[name] for step in measured if name in step]
        if values:
            out[name] = combine(values)
    return {**out, **_rollout_engine_mismatch(steps)}


def _rollout_engine_mismatch(steps: list[dict[str, float]]) -> dict[str, float]:
    """``mismatch/...`` over the optimizer steps that measured it (those on the batch-start weights)."""
    measured = [step for step in steps if step.get("mismatch/tokens")]
    if not measured:
        return {}
    tokens = sum(step["mismatch/tokens"] for step in measured)
    return {"mismatch/abs_diff_mean": sum(s["mismatch/abs_diff_mean"] * s["mismatch/tokens"] for s in measured) / tokens,
            "mismatch/kl": sum(s["mismatch/kl"] * s["mismatch/tokens"] for s in measured) / tokens,
            "mismatch/abs_diff_max": max(s["mismatch/abs_diff_max"] for s in measured), "mismatch/tokens": tokens}
