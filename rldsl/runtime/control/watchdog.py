"""The watchdog: a run that stops moving ends with a report, not a hang.

Progress is any pump moving (a group ready, a microbatch trained, a push)
*or* a generator decoding tokens. The stall time is the run's `watchdog`,
or longer where one `max_new_tokens` response at the generators' measured
decode rate takes longer (decode_rate.py). With long responses (thousands of tokens)
a single group can take longer than the timeout while the generators work
steadily; counting their decoded tokens keeps such a run alive, while a
generator that decodes nothing (a hung engine) still stops it.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from rldsl.runtime.control.decode_rate import describe_stall_timeout, stall_timeout
from rldsl.runtime.control.errors import PipelineStalled
from rldsl.runtime.control.state import RunState

TOKEN_POLL_TIMEOUT_S = 10.0  # a poll that gets no answer counts as no token progress


class Watchdog:
    """Raises ``PipelineStalled`` when neither the pumps nor the generators'
    decoded tokens have moved for ``settings.watchdog_timeout_s``.

    ``decoded_tokens`` (the lowering's ``StageHandles.decoded_tokens``)
    returns the tokens each generator replica has decoded so far; it is
    polled every tick, and any change counts as progress."""

    def __init__(self, state: RunState, describe_waits: Callable[[], str],
                 decoded_tokens: Callable[[], Awaitable[list[int]]] | None = None) -> None:
        self.state = state
        self.describe_waits = describe_waits
        self.decoded_tokens = decoded_tokens
        self.tokens: list[int] | None = None  # the last poll's counts
        self.token_progress_at: float | None = None  # when they last changed
        self.token_resets = 0  # ticks where tokens alone kept the run alive (no pump had moved)

    async def run(self) -> None:
        timeout = self.state.settings.watchdog_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 10, 1.0))
            await self.check()

    async def check(self) -> None:
        """One tick: poll the generators' tokens, then judge."""
        state, timeout = self.state, self.timeout()
        await self._poll_tokens()
        now = state.clock()
        idle = now - state.last_progress
        if idle < timeout:
            return
        if self.token_progress_at is not None and now - self.token_progress_at < timeout:
            self.token_resets += 1
            return
        raise PipelineStalled(f"no progress for {idle:.1f}s ({self._describe_timeout()}){self._token_note(now)}: "
                              f"{self.describe_waits()}")

    def timeout(self) -> float:
        """The run's `watchdog`, or longer where one `max_new_tokens` response at the measured decode rate
        takes longer than a third of it (decode_rate.py)."""
        settings, rate = self.state.settings, self.state.decode_rate.tokens_per_s()
        return stall_timeout(settings.watchdog_timeout_s, settings.max_new_tokens, rate)

    def _describe_timeout(self) -> str:
        settings = self.state.settings
        return describe_stall_timeout(settings.watchdog_timeout_s, settings.max_new_tokens,
                                      self.state.decode_rate.tokens_per_s())

    async def _poll_tokens(self) -> None:
        if self.decoded_tokens is None:
            return
        try:
            counts = list(await asyncio.wait_for(self.decoded_tokens(), TOKEN_POLL_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - an unanswered poll is simply no evidence of progress
            return
        if self.tokens is not None and counts != self.tokens:
            self.token_progress_at = self.state.clock()
        self.tokens = counts

    def _token_note(self, now: float) -> str:
        if self.decoded_tokens is None or self.tokens is None:
            return ""
        if self.token_progress_at is None:
            return f"; the generators decoded no token either ({sum(self.tokens)} decoded in all)"
        return (f"; the generators decoded no token for {now - self.token_progress_at:.1f}s "
                f"({sum(self.tokens)} decoded in all)")
