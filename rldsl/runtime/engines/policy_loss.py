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
``rollout_correction`` and slime's TIS).

With ``behaviour_cap`` or a correction, the clipped ratio is taken against
the proximal policy (the weights the rollout batch started with) and every
token is weighted by w = pi_prox / pi_behaviour. The proximal logprobs are
passed in when the trainer recomputed them at the batch start (several
optimizer steps per rollout batch); otherwise they are the trainer's own
logprobs detached, the same thing before the batch's first optimizer step.

The loss returns an UN-normalised sum plus the local count it is divided by
(tokens for ``agg = "token_mean"``, sequences otherwise), so a split train
step can accumulate microbatches and divide once by the global count when
it steps the optimizer. Every statistic is a sum too, so microbatches and
data-parallel ranks add up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_PLACEMENTS = ("loss", "reward")
RATIO_LEVELS = ("token", "sequence")
CORRECTIONS = ("none", "is", "tis", "mis", "icepop")
CORRECTION_LEVELS = ("token", "sequence")
# (low, high) bounds of the weight when left out: verl's and slime's 2.0; IcePop's two-sided [0.5, 5];
# ``is`` has none (NeMo RL's importance sampling correction with no truncation ratio).
DEFAULT_CORRECTION_BOUNDS = {"is": (0.0, math.inf), "tis": (0.0, 2.0), "mis": (0.0, 2.0), "icepop": (0.5, 5.0)}
# Summable statistics of one microbatch, besides the loss sum. ``capped_tokens``: tokens whose weight a
# correction (or behaviour_cap) truncated or masked; ``mismatch_*``: generator vs proximal logprobs.
STAT_NAMES = ("tokens", "sequences", "kl_sum", "clipped_tokens", "dual_clipped_tokens", "capped_tokens", "ratio_sum",
              "mismatch_kl_sum", "mismatch_k3_sum", "mismatch_ratio_sum")
# Per-token extremes of pi_prox / pi_behaviour: combined by max / min, not summed.
EXTREME_STATS = {"mismatch_ratio_max": max, "mismatch_ratio_min": min}


@dataclass(frozen=True)
class PolicyLossConfig:
    clip: float = 0.2  # low side: the ratio is kept >= 1 - clip
    clip_high: float | None = None  # high side: <= 1 + clip_high; None: clip (DAPO sets it higher)
    dual_clip: float = 0.0  # 0: off; c > 1 caps a negative advantage's token loss at -A * c
    kl: float = 0.0  # coefficient of the KL to the reference
    kl_estimator: str = "k3"  # k1: d, k2: d^2 / 2, k3: e^-d + d - 1, with d = logp - ref
    kl_in: str = "loss"  # "loss": a differentiable term; "reward": a per-token reward penalty
    agg: str = "token_mean"
    ratio: str = "token"  # "sequence": GSPO's length-normalised sequence ratio
    behaviour_cap: float = 0.0  # 0: off; else the decoupled objective, weights above the cap masked
    kl_input_clamp: float = 0.0  # 0: off; else d = logp - ref is clamped to [-c, c] before the estimator
    kl_output_clamp: float = 0.0  # 0: off; else each token's KL estimate is clamped to [-c, c]
    correction: str = "none"  # is: weight as is; tis: clamped to [low, high]; mis / icepop: 0 outside [low, high]
    correction_level: str = "token"  # "sequence": w is the product of the response's token weights
    correction_low: float | None = None  # None: DEFAULT_CORRECTION_BOUNDS
    correction_high: float | None = None

    def __post_init__(self):
        _check_choice("agg", self.agg, AGGREGATIONS)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("kl_in", self.kl_in, KL_PLACEMENTS)
        _check_choice("ratio", self.ratio, RATIO_LEVELS)
        _check_choice("correction", self.correction, CORRECTIONS)
        _check_choice("correction_level", self.correction_level, CORRECTION_LEVELS)
        self._check_correction()
        if not 0 <= self.clip < 1:
            raise ValueError(f"clip {self.clip} must be in [0, 1)")
        if self.clip_high is not None and self.clip_high < 0:
            raise ValueError(f"clip_high {self.clip_high} must be >= 0")
        if self.dual_clip != 0 and self.dual_clip <= 1:
            raise ValueError(f"dual_clip {self.dual_clip} must be 0 (off) or > 1")
        if self.kl < 0:
            raise ValueError(f"kl coefficient {self.kl} must be >= 0")
        if self.behaviour_cap != 0 and self.behaviour_cap < 1:
            raise ValueError(f"behaviour_cap {self.behaviour_cap} must be 0 (off) or >= 1")
        if self.kl_input_clamp < 0 or self.kl_output_clamp < 0:
            raise ValueError(f"kl_input_clamp {self.kl_input_clamp} and kl_output_clamp {self.kl_output_clamp} "
                             "must be >= 0 (0: off)")

    def _check_correction(self) -> None:
        if self.correction == "none":
            return
        if self.behaviour_cap:
            raise ValueError(f"behaviour_cap and correction {self.correction!r} both weight the tokens: use one")
        if self.correction == "is" and (self.correction_low, self.correction_high) != (None, None):
            raise ValueError("correction 'is' leaves the weight untruncated: correction_low and correction_high "
                             "bound tis, mis and icepop only")
        if self.correction == "icepop" and self.correction_level != "token":
            raise ValueError("correction 'icepop' masks tokens: correction_level must be 'token' (or use 'mis')")
        low, high = self.correction_bounds
        if not 0 <= low <= 1 <= high:
            raise ValueError(f"correction bounds [{low}, {high}] must satisfy 0 <= correction_low <= 1 <= "
                             "correction_high (an on-policy token, weight 1, is always kept whole)")

    @property
    def correction_bounds(self) -> tuple[float, float]:
        """(low, high) of the importance weight; behaviour_cap is a token mask at (0, cap)."""
        if self.behaviour_cap:
            return 0.0, self.behaviour_cap
        low, high = DEFAULT_CORRECTION_BOUNDS.get(self.correction, (0.0, 0.0))
        return (low if self.correction_low is None else self.correction_low,
                high if self.correction_high is None else self.correction_high)

    @property
    def needs_proximal(self) -> bool:
        """The loss is taken against the batch-start (proximal) policy: exact
        over several optimizer steps only with a proximal pass."""
        return bool(self.behaviour_cap) or self.correction != "none"

    @property
    def kl_clamps(self) -> dict[str, float]:
        return {"input_clamp": self.kl_input_clamp, "output_clamp": self.kl_output_clamp}

    @property
    def upper_clip(self) -> float:
        return self.clip if self.clip_high is None else self.clip_high

    @property
    def count_name(self) -> str:
        """The statistic the loss sum is divided by: ``tokens`` or ``sequences``."""
        return "tokens" if self.agg == "token_mean" else "sequences"


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"loss {name} {value!r}: expected one of {', '.join(choices)}")


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
    config: PolicyLossConfig = PolicyLossConfig(),
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
    ratio = _ratio((logprobs - anchor) * mask, mask, config.ratio)
    advantage = _token_advantages(advantages.to(logprobs.dtype), behaviour, ref_logprobs, mask, config)
    per_token, clipped, dual_clipped = _clipped_objective(ratio, advantage, config)
    per_token = per_token * weight
    kl = torch.zeros_like(per_token)
    if config.kl > 0:
        kl_from = logprobs if config.kl_in == "loss" else behaviour
        kl = kl_estimate(kl_from, ref_logprobs.to(logprobs.dtype), config.kl_estimator, **config.kl_clamps)
        if config.kl_in == "loss":
            per_token = per_token + config.kl * kl
    loss_sum, count = _aggregate(per_token * kept, mask, config.agg)
    stats = _stats(mask, kl, ratio, clipped, dual_clipped, corrected)
    stats.update(mismatch_stats(proximal, behaviour, mask))
    return LossSums(loss_sum, count, stats)


@torch.no_grad()
def correction_weights(proximal, behaviour, mask, config: PolicyLossConfig):
    """Each token's importance weight, which tokens the loss keeps and which
    the correction truncated or masked (all [n, L], 0 off the mask).

    w = pi_prox / pi_behaviour per token, or at ``correction_level =
    "sequence"`` the product over the response (verl's sequence level),
    broadcast over its tokens. ``tis`` clamps w to [low, high] (truncated
    IS); ``mis`` and ``icepop`` (token level) keep w inside [low, high] and
    drop the token or sequence outside; ``behaviour_cap`` drops tokens above
    the cap (AReaL); ``is`` keeps w whole, dropping only a weight that
    overflowed to infinity (as NeMo RL zeroes it). Dropped tokens still
    count in N, as in AReaL.
    """
    if not config.needs_proximal:
        return torch.ones_like(mask), mask, torch.zeros_like(mask)
    log_weight = (proximal - behaviour) * mask
    if config.correction_level == "sequence":
        log_weight = log_weight.sum(dim=1, keepdim=True).expand_as(mask)
    weight = torch.exp(log_weight)
    low, high = config.correction_bounds
    inside = (weight >= low) & (weight <= high) & torch.isfinite(weight)
    outside = mask * (~inside).to(mask.dtype)
    if config.correction == "tis":
        return weight.clamp(min=low, max=high) * mask, mask, outside
    return torch.where(inside, weight, torch.zeros_like(weight)) * mask, mask - outside, outside


def _ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Per-token ratio, or GSPO's exp(mean log ratio) of each sequence broadcast
    over its tokens (the gradient flows through the mean)."""
    if level == "token":
        return torch.exp(log_ratio)
    mean_log_ratio = log_ratio.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return torch.exp(mean_log_ratio)[:, None].expand_as(log_ratio)


def _token_advantages(advantages, behaviour, ref_logprobs, mask, config: PolicyLossConfig) -> torch.Tensor:
    """[n, L]: the sequence advantage, plus, with ``kl_in = "reward"``, the
    return of the per-token KL penalties from each token to the response's end
    (REINFORCE++; no gradient: behaviour and reference logprobs are data)."""
    advantage = advantages[:, None].expand_as(mask)
    if config.kl_in != "reward" or config.kl == 0:
        return advantage
    kl = kl_estimate(behaviour, ref_logprobs.to(behaviour.dtype), config.kl_estimator, **config.kl_clamps)
    penalty = -config.kl * kl * mask
    returns = penalty.flip(1).cumsum(dim=1).flip(1)
    return advantage + returns.detach()


def _clipped_objective(ratio, advantage, config: PolicyLossConfig):
    """Per-token loss -min(r A, clip(r) A), dual-clipped; and where each clip acted."""
    unclipped = -ratio * advantage
    clipped = -torch.clamp(ratio, 1 - config.clip, 1 + config.upper_clip) * advantage
    per_token = torch.maximum(unclipped, clipped)
    clip_taken = clipped > unclipped
    dual_taken = torch.zeros_like(clip_taken)
    if config.dual_clip:
        cap = -advantage * config.dual_clip
        dual_taken = (advantage < 0) & (per_token > cap)
        per_token = torch.where(dual_taken, cap, per_token)
    return per_token, clip_taken, dual_taken


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str) -> tuple[torch.Tensor, float]:
    """(sum, count): the loss is sum / count over the whole batch."""
    tokens_per_sequence = mask.sum(dim=1)
    if agg == "token_mean":
        return per_token.sum(), float(tokens_per_sequence.sum())
    has_tokens = tokens_per_sequence > 0
    per_sequence = per_token.sum(dim=1)
    if agg == "seq_mean_token_mean":
        per_sequence = per_sequence / tokens_per_sequence.clamp(min=1)
    return per_sequence[has_tokens].sum(), float(has_tokens.sum())


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
    return {**dict.fromkeys(STAT_NAMES, 0.0), "mismatch_ratio_max": float("-inf"),
            "mismatch_ratio_min": float("inf")}


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
    out.update({name: totals[name] for name in EXTREME_STATS if abs(totals.get(name, float("inf"))) < float("inf")})
    return out


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
        return {}
    tokens = sum(step["tokens"] for step in measured) or 1.0
    out = {name: sum(step[name] * step["tokens"] for step in measured) / tokens
           for name in ("mismatch_kl", "mismatch_k3", "mismatch_ratio_mean", "capped_fraction") if name in measured[0]}
    for name, combine in EXTREME_STATS.items():
        values = [step[name] for step in measured if name in step]
        if values:
            out[name] = combine(values)
    return out


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3",
                input_clamp: float = 0.0, output_clamp: float = 0.0) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from d = logp - ref:
    k1 = d, k2 = d^2 / 2, k3 = e^-d + d - 1 (unbiased, >= 0; "low_var_kl").
    Nonzero clamps bound d, then the estimate, to [-c, c] (NeMo RL's
    ``kl_input_clamp_value`` / ``kl_output_clamp_value``): k3 grows like
    e^-d, so one token far below the reference would dominate the loss."""
    delta = logprobs - ref_logprobs
    if input_clamp:
        delta = delta.clamp(-input_clamp, input_clamp)
    if estimator == "k1":
        kl = delta
    elif estimator == "k2":
        kl = 0.5 * delta.square()
    elif estimator == "k3":
        kl = torch.exp(-delta) + delta - 1
    else:
        raise ValueError(f"kl estimator {estimator!r}: expected one of {', '.join(KL_ESTIMATORS)}")
    return kl.clamp(-output_clamp, output_clamp) if output_clamp else kl
