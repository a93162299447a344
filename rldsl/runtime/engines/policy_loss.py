"""The clipped policy-gradient loss family as a pure torch function.

One function covers GRPO / PPO's clipped surrogate and the variants real RL
frameworks use: DAPO's clip-higher (``clip_high``), dual clip for negative
advantages (``dual_clip``, verl's ``clip_ratio_c``), a KL to the reference
in the loss or as a per-token reward penalty (REINFORCE++), GSPO's
sequence-level ratio (``ratio = "sequence"``) and AReaL's decoupled
objective with a capped behaviour importance weight (``behaviour_cap``).

The loss returns an UN-normalised sum plus the local count it is divided by
(tokens for ``agg = "token_mean"``, sequences otherwise), so a split train
step can accumulate microbatches and divide once by the global count when
it steps the optimizer. Every statistic is a sum too, so microbatches and
data-parallel ranks add up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_PLACEMENTS = ("loss", "reward")
RATIO_LEVELS = ("token", "sequence")
# Summable statistics of one microbatch, besides the loss sum.
STAT_NAMES = ("tokens", "sequences", "kl_sum", "clipped_tokens", "dual_clipped_tokens", "capped_tokens", "ratio_sum")


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

    def __post_init__(self):
        _check_choice("agg", self.agg, AGGREGATIONS)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("kl_in", self.kl_in, KL_PLACEMENTS)
        _check_choice("ratio", self.ratio, RATIO_LEVELS)
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
) -> LossSums:
    """The clipped policy-gradient loss (+ optional KL) summed over a microbatch.

    Shapes: logprobs / behaviour_logprobs / ref_logprobs / mask [n, L],
    advantages [n] (one per sequence, broadcast over its tokens).
    """
    if config.kl > 0 and ref_logprobs is None:
        raise ValueError("the loss has a KL term but the batch has no ref_logprobs")
    mask = mask.to(logprobs.dtype)
    behaviour = behaviour_logprobs.to(logprobs.dtype)
    anchor, weight, kept = _decoupled_anchor(logprobs, behaviour, mask, config)
    ratio = _ratio((logprobs - anchor) * mask, mask, config.ratio)
    advantage = _token_advantages(advantages.to(logprobs.dtype), behaviour, ref_logprobs, mask, config)
    per_token, clipped, dual_clipped = _clipped_objective(ratio, advantage, config)
    per_token = per_token * weight
    kl = torch.zeros_like(per_token)
    if config.kl > 0:
        kl_from = logprobs if config.kl_in == "loss" else behaviour
        kl = kl_estimate(kl_from, ref_logprobs.to(logprobs.dtype), config.kl_estimator)
        if config.kl_in == "loss":
            per_token = per_token + config.kl * kl
    loss_sum, count = _aggregate(per_token * kept, mask, config.agg)
    stats = _stats(mask, kept, kl, ratio, clipped, dual_clipped)
    return LossSums(loss_sum, count, stats)


def _decoupled_anchor(logprobs, behaviour, mask, config: PolicyLossConfig):
    """What the ratio is taken against, each token's weight and the tokens kept.

    Decoupled (AReaL): the ratio is against the proximal policy, the
    trainer's own logprobs detached (the weights at the start of this
    optimizer step; exact when a rollout batch takes one optimizer step), and
    each token is weighted by w = pi_prox / pi_behaviour, tokens with w above
    the cap left out of the loss (they still count in N, as in AReaL).
    """
    if not config.behaviour_cap:
        return behaviour, torch.ones_like(mask), mask
    proximal = logprobs.detach()
    weight = torch.exp((proximal - behaviour) * mask)
    kept = mask * (weight <= config.behaviour_cap).to(mask.dtype)
    return proximal, weight * kept, kept


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
    penalty = -config.kl * kl_estimate(behaviour, ref_logprobs.to(behaviour.dtype), config.kl_estimator) * mask
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
def _stats(mask, kept, kl, ratio, clipped, dual_clipped) -> dict[str, float]:
    tokens_per_sequence = mask.sum(dim=1)
    return {
        "tokens": float(tokens_per_sequence.sum()),
        "sequences": float((tokens_per_sequence > 0).sum()),
        "kl_sum": float((kl * mask).sum()),
        "clipped_tokens": _count_on(clipped, mask),
        "dual_clipped_tokens": _count_on(dual_clipped, mask),
        "capped_tokens": float((mask - kept).sum()),
        "ratio_sum": float((ratio * mask).sum()),
    }


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
    }


def rollout_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """A rollout batch's metrics from its optimizer steps': the last step's,
    the number of steps and the mean loss over them."""
    return {**steps[-1], "optimizer_steps": float(len(steps)),
            "loss": sum(step["loss"] for step in steps) / len(steps)}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from d = logp - ref:
    k1 = d, k2 = d^2 / 2, k3 = e^-d + d - 1 (unbiased, >= 0; "low_var_kl")."""
    delta = logprobs - ref_logprobs
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        return torch.exp(-delta) + delta - 1
    raise ValueError(f"kl estimator {estimator!r}: expected one of {', '.join(KL_ESTIMATORS)}")
