"""The GRPO loss as a pure torch function, and group-normalised advantages.

The loss returns an UN-normalised sum plus the local count it should be
divided by (tokens for ``level="token"``, sequences for ``"sequence"``), so a
split train step can accumulate microbatches and divide once by the global
count at finish. ``sum / count`` over the whole batch is the usual loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class GRPOLossConfig:
    clip: float = 0.2  # ratio clipped to [1 - clip, 1 + clip]
    kl: float = 0.0  # coefficient of the k3 KL estimate to the reference
    level: str = "token"

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"loss level {self.level!r}: expected one of {', '.join(LEVELS)}")
        if not 0 <= self.clip < 1:
            raise ValueError(f"clip {self.clip} must be in [0, 1)")
        if self.kl < 0:
            raise ValueError(f"kl coefficient {self.kl} must be >= 0")


@dataclass
class LossSums:
    """A microbatch's contribution: ``loss_sum`` and the count it is divided by."""

    loss_sum: torch.Tensor  # differentiable scalar
    count: float
    stats: dict[str, float] = field(default_factory=dict)  # sums over tokens / sequences


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOLossConfig = GRPOLossConfig(),
    ref_logprobs: torch.Tensor | None = None,
) -> LossSums:
    """Clipped-ratio policy gradient (+ optional KL) summed over a microbatch.

    Shapes: logprobs / behaviour_logprobs / ref_logprobs / mask [n, L],
    advantages [n] (one per sequence, broadcast over its tokens).
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - behaviour_logprobs)
    advantage = advantages.to(logprobs.dtype)[:, None]
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1 - config.clip, 1 + config.clip) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(per_token)
    if config.kl > 0:
        if ref_logprobs is None:
            raise ValueError("the loss has a KL term but the batch has no ref_logprobs")
        kl = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + config.kl * kl
    tokens_per_sequence = mask.sum(dim=1)
    if config.level == "token":
        loss_sum = (per_token * mask).sum()
        count = float(tokens_per_sequence.sum())
    else:
        has_tokens = tokens_per_sequence > 0
        per_sequence = (per_token * mask).sum(dim=1) / tokens_per_sequence.clamp(min=1)
        loss_sum = per_sequence[has_tokens].sum()
        count = float(has_tokens.sum())
    return LossSums(loss_sum, count, _stats(ratio, unclipped, clipped, kl, mask))


@torch.no_grad()
def _stats(ratio, unclipped, clipped, kl, mask) -> dict[str, float]:
    tokens_per_sequence = mask.sum(dim=1)
    return {
        "tokens": float(tokens_per_sequence.sum()),
        "sequences": float((tokens_per_sequence > 0).sum()),
        "kl_sum": float((kl * mask).sum()),
        "clipped_tokens": float(((unclipped != clipped).to(mask.dtype) * mask).sum()),
        "ratio_sum": float((ratio * mask).sum()),
    }


def step_metrics(totals: dict[str, float], count: float, grad_norm, lr: float) -> dict[str, float]:
    """A finished step's metrics from the summed statistics of its microbatches
    (``count`` is the global token or sequence count the loss was divided by)."""
    tokens = max(totals["tokens"], 1.0)
    return {
        "loss": totals["loss_sum"] / count,
        "kl": totals["kl_sum"] / tokens,
        "clip_fraction": totals["clipped_tokens"] / tokens,
        "mean_ratio": totals["ratio_sum"] / tokens,
        "tokens": totals["tokens"],
        "sequences": totals["sequences"],
        "grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
        "lr": lr,
    }


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): e^d - d - 1, d = ref - policy."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1
