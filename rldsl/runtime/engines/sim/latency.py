"""The sim engines' latency model: how long a simulated call takes.

``Latency`` draws seeded per-call durations (constant, uniform or lognormal,
with an optional long tail); ``Timed`` is the base of every sim engine: it
owns the seeded random stream and holds each async call on an exact timeline.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Latency:
    """Seconds per call: constant, uniform or lognormal, plus an optional
    long tail (with probability ``tail_prob`` the draw is multiplied by
    ``tail_mult``)."""

    kind: str = "constant"  # "constant" | "uniform" | "lognormal"
    seconds: float = 0.0  # the constant, the uniform low end, or the lognormal median
    high: float = 0.0  # uniform high end
    sigma: float = 0.0  # lognormal spread
    tail_prob: float = 0.0
    tail_mult: float = 1.0

    @classmethod
    def constant(cls, seconds: float, tail_prob: float = 0.0, tail_mult: float = 1.0) -> Latency:
        return cls("constant", seconds, tail_prob=tail_prob, tail_mult=tail_mult)

    @classmethod
    def uniform(cls, low: float, high: float, tail_prob: float = 0.0, tail_mult: float = 1.0) -> Latency:
        return cls("uniform", low, high=high, tail_prob=tail_prob, tail_mult=tail_mult)

    @classmethod
    def jittered(cls, seconds: float, jitter: float = 0.0, tail_prob: float = 0.0, tail_mult: float = 1.0) -> Latency:
        """``seconds`` give or take the fraction ``jitter``: the language's
        ``sim(latency = 50ms, jitter = 20%, tail = 5%, tail_factor = 8)``."""
        return cls.uniform(seconds * (1 - jitter), seconds * (1 + jitter), tail_prob, tail_mult)

    @classmethod
    def lognormal(cls, median: float, sigma: float = 0.5, tail_prob: float = 0.0, tail_mult: float = 1.0) -> Latency:
        return cls("lognormal", median, sigma=sigma, tail_prob=tail_prob, tail_mult=tail_mult)

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "uniform", "lognormal"):
            raise ValueError(f"unknown latency kind {self.kind!r}")
        if self.seconds < 0 or self.high < 0 or not 0 <= self.tail_prob <= 1 or self.tail_mult < 0:
            raise ValueError(f"invalid latency {self}")

    @property
    def typical(self) -> float:
        """A call's usual duration without the tail: the constant, the uniform
        mid-point or the lognormal median."""
        return (self.seconds + max(self.high, self.seconds)) / 2 if self.kind == "uniform" else self.seconds

    def sample(self, rng: random.Random) -> float:
        if self.kind == "uniform":
            value = rng.uniform(self.seconds, max(self.high, self.seconds))
        elif self.kind == "lognormal":
            value = self.seconds * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        else:
            value = self.seconds
        if self.tail_prob and rng.random() < self.tail_prob:
            value *= self.tail_mult
        return value


class Timed:
    """Seeded draws for one engine, and its timeline of back-to-back calls."""

    def __init__(self, latency: Latency, seed: int) -> None:
        self.latency = latency
        self._rng = random.Random(seed)
        self._busy_until = 0.0

    def _draw(self) -> float:
        return self.latency.sample(self._rng)

    async def _hold(self, seconds: float, requested_at: float | None = None) -> None:
        """Sleep so the call ends ``seconds`` after it could start: when it
        was requested or when this engine's previous call ended, whichever is
        later. Back-to-back calls thus keep an exact timeline instead of
        adding up the event loop's wake-up jitter (1-3 ms per sleep here)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = min(now, max(now if requested_at is None else requested_at, self._busy_until))
        self._busy_until = start + seconds
        await asyncio.sleep(max(0.0, self._busy_until - now))

    def _chance(self, probability: float) -> bool:
        return probability > 0 and self._rng.random() < probability

