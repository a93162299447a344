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
