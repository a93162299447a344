"""Data-parallel lanes: every trainer replica busy, each one in order.

A step's groups are assigned to the trainer's data-parallel replicas as they
arrive. Each replica gets the same number of microbatches per step (unequal
counts deadlock collectives that run per microbatch, e.g. across pipeline
stages), and among the replicas still below their share, the one with the
fewest tokens so far takes the next group, so the replicas finish together.
Each replica's microbatches run one at a time and in order; the replicas run
concurrently. A failure is kept and reported once the lanes are drained, so
the step is aborted only after no microbatch of it is still running.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable


class MicrobatchLanes:
    def __init__(self, replicas: int, on_change: Callable[[], None],
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.replicas = max(1, replicas)
        self._on_change = on_change
        self._stopping = stopping  # a stop was requested: microbatches not yet started are skipped
        self._tails: list[asyncio.Task | None] = [None] * self.replicas
        self.counts = [0] * self.replicas
        self.tokens = [0] * self.replicas
        self._quota = [0] * self.replicas
        self.failure: BaseException | None = None
        self.running = [0] * self.replicas

    def open_step(self, groups: int) -> None:
        """A new step of ``groups`` prompt groups: every replica's share."""
        base, extra = divmod(groups, self.replicas)
        self._quota = [base + (1 if r < extra else 0) for r in range(self.replicas)]
        self.counts = [0] * self.replicas
        self.tokens = [0] * self.replicas
        self.failure = None

    def assign(self, tokens: int) -> int:
        """The replica for a group of ``tokens`` response tokens."""
        below_share = [r for r in range(self.replicas) if self.counts[r] < self._quota[r]]
        candidates = below_share or range(self.replicas)
        replica = min(candidates, key=lambda r: (self.tokens[r], self.counts[r], r))
        self.counts[replica] += 1
        self.tokens[replica] += tokens
        return replica

    def submit(self, replica: int, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` on ``replica`` after its earlier microbatches."""
        previous = self._tails[replica]
        self._tails[replica] = asyncio.create_task(self._run_after(previous, replica, work))

    async def _run_after(self, previous: asyncio.Task | None, replica: int,
                         work: Callable[[], Awaitable[None]]) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        if self.failure is not None or self._stopping():
            return  # the step ends unfinished anyway: do not start more of it
        self.running[replica] += 1
        try:
            await work()
        except Exception as error:
            if self.failure is None:
                self.failure = error
            self._on_change()
        finally:
            self.running[replica] -= 1

    @property
    def in_flight(self) -> int:
        return sum(1 for task in self._tails if task is not None and not task.done())

    async def drain(self) -> BaseException | None:
        """Wait until no microbatch runs; the first failure, if any."""
        tails = [task for task in self._tails if task is not None]
        if tails:
            await asyncio.wait(tails)
        self._tails = [None] * self.replicas
        return self.failure

    def cancel(self) -> None:
        for task in self._tails:
            if task is not None:
                task.cancel()

    def describe(self) -> str:
        running = [r for r in range(self.replicas) if self.running[r]]
        shares = ", ".join(f"{r}: {self.counts[r]}/{self._quota[r]} ({self.tokens[r]} tokens)"
                           for r in range(self.replicas))
        return f"in train_microbatch on trainer replicas {running}; microbatches per replica {shares}"
