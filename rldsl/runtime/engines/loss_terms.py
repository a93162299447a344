"""The pieces of the policy loss (``policy_loss.policy_loss`` puts them
together): the KL estimate, the rollout correction's token weights, the
ratio, the clipped objective and the aggregation into a sum and its count.
Pure torch functions of [n, L] tensors."""

from __future__ import annotations

import torch

from rldsl.runtime.engines.loss_config import KL_ESTIMATORS, PolicyLossConfig


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3",
                input_clamp: float = 0.0, output_clamp: float = 0.0) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from d = logp - ref:
    k1 = d, k2 = d^2 / 2, k3 = e^-d + d - 1 (unbiased, >= 0; "low_var_kl").
    Nonzero clamps bound d, then the estimate, to [-c, c] (NeMo RL's
    ``kl_input_clamp_value`` / ``kl_output_clamp_value``, verl's low_var_kl
    at 20 and 10, OpenRLHF's output at 10): k3 grows like e^-d, so one token
    far below the reference would dominate the loss."""
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
    overflowed to infinity (as NeMo RL zeroes it). What a dropped token
    keeps (its KL term, its count) is ``rejected``'s business.
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


def policy_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Per-token ratio, or GSPO's exp(mean log ratio over ``mask``) of each
    sequence broadcast over its tokens (the gradient flows through the mean)."""
    if level == "token":
        return torch.exp(log_ratio)
    mean_log_ratio = (log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return torch.exp(mean_log_ratio)[:, None].expand_as(log_ratio)


def token_advantages(advantages, behaviour, ref_logprobs, mask, config: PolicyLossConfig) -> torch.Tensor:
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


def clipped_objective(ratio, advantage, config: PolicyLossConfig):
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


def aggregate(per_token: torch.Tensor, counted: torch.Tensor, config: PolicyLossConfig) -> tuple[torch.Tensor, float]:
    """(sum, count): the loss is sum / count over the whole optimizer step.

    ``counted``: the tokens the mean counts (the trained tokens, less the
    rejected ones with ``rejected = "unmask"``). ``micro_token_mean``
    divides here by this forward's tokens and counts one forward, so the
    step averages its forwards' token means. ``count_masked`` counts every
    row in a sequence mean, a row without tokens adding 0 to the sum (TRL).
    """
    tokens_per_sequence = counted.sum(dim=1)
    if config.agg in ("token_mean", "micro_token_mean"):
        tokens = float(tokens_per_sequence.sum())
        if config.agg == "token_mean":
            return per_token.sum(), tokens
        return per_token.sum() / max(tokens, 1.0), float(tokens > 0)
    per_sequence = per_token.sum(dim=1)
    if config.agg == "seq_mean_token_mean":
        per_sequence = per_sequence / tokens_per_sequence.clamp(min=1)
    if config.length_norm:
        per_sequence = per_sequence / config.length_norm
    if config.count_masked:
        return per_sequence.sum(), float(len(per_sequence))
    has_tokens = tokens_per_sequence > 0
    return per_sequence[has_tokens].sum(), float(has_tokens.sum())
