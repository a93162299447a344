"""The generators' measured decode rate, and the watchdog's stall time from it.

A healthy generator can report no token for as long as one response takes
to decode: an engine that returns a group whole, a long prefill, a replica
evaluating, a single group of 8k-token responses on a loaded GPU. A fixed
`run { watchdog }` (120 s) that suits the builtin CPU pipelines' 16-token
answers would stop such a run. So the watchdog waits the longer of
`watchdog` and STALL_FACTOR times the time one `max_new_tokens` response
takes at the rate measured here (8192 tokens at 20 tokens/s: 410 s, so
20 min); a generator that decodes nothing at all is still caught, only
later. Before the first group has come back nothing is measured and
`watchdog` holds.

The rate of one generate call is its longest response's tokens over the
call's seconds: the sequences of a batch decode side by side, each at that
rate. The median of the last WINDOW calls keeps one call that also waited
(a replica asleep while the trainer steps, a weight push) from stretching
the stall time.
"""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 32
STALL_FACTOR = 3.0


class DecodeRate:
    """Tokens per second of one sequence, over the last WINDOW generate calls."""

    def __init__(self) -> None:
        self._rates: deque[float] = deque(maxlen=WINDOW)

    def record(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._rates.append(tokens / seconds)

    def tokens_per_s(self) -> float | None:
        return statistics.median(self._rates) if self._rates else None


def longest_response(tokens: int, sample_tokens: tuple[int, ...], samples: int) -> int:
    """A group's longest response in tokens: the longest sample's, else the mean (an engine that reports only the
    group's total: a lower rate, so a longer stall time)."""
    return max(sample_tokens) if sample_tokens else tokens // max(1, samples)


def stall_timeout(watchdog_s: float, max_new_tokens: int, tokens_per_s: float | None) -> float:
    """How long the watchdog lets every pump and generator stay still."""
    if not max_new_tokens or not tokens_per_s:
        return watchdog_s
    return max(watchdog_s, STALL_FACTOR * max_new_tokens / tokens_per_s)


def describe_stall_timeout(watchdog_s: float, max_new_tokens: int, tokens_per_s: float | None) -> str:
    """`watchdog 120s`, or why it is longer: `watchdog 1229s: 3 x 8192-token responses at 20.0 tokens/s`."""
    timeout = stall_timeout(watchdog_s, max_new_tokens, tokens_per_s)
    if timeout == watchdog_s:
        return f"watchdog {watchdog_s:g}s"
    return (f"watchdog {timeout:.0f}s: {STALL_FACTOR:g} x {max_new_tokens}-token responses at the measured "
            f"{tokens_per_s:.1f} tokens/s")
