"""GRPO advantages: rewards normalised within each prompt group."""

from __future__ import annotations

import math
from typing import Sequence


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """(reward - mean) / (std + eps) over one prompt group.

    ``std`` is the unbiased (n - 1) estimate, as torch.std computes it. A
    group whose rewards are all equal (or that has a single sample) carries
    no learning signal and gets exact zeros, not noise divided by eps.
    """
    n = len(rewards)
    if n == 0:
        return []
    mean = math.fsum(rewards) / n
    if n == 1 or all(r == rewards[0] for r in rewards):
        return [0.0] * n
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]


def batch_advantages(rewards, group_size: int, eps: float = 1e-6):
    """``group_advantages`` over a float tensor of prompt-major rows, in
    groups of ``group_size``; returns a float32 tensor of the same length."""
    import torch

    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    values = rewards.double().view(-1, group_size).tolist()
    return torch.tensor([a for group in values for a in group_advantages(group, eps)], dtype=torch.float32)
