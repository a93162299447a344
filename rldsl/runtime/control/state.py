"""The state the controller's pumps share.

Everything runs on one asyncio loop, so the state needs no locks: a pump
reads and mutates it between awaits and calls ``changed.notify()``; every
waiting pump then wakes and re-checks its own condition.
"""

from __future__ import annotations

import asyncio
import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from rldsl.runtime.control.buffer import Group, ReplayBuffer
from rldsl.runtime.control.handles import StageHandles
from rldsl.runtime.control.ledger import Ledger
from rldsl.runtime.control.sampler import StalenessSampler, TrainProgress
from rldsl.runtime.control.settings import RunSettings


class Notifier:
    """Wakes every waiter on each state change; waiters re-check themselves."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class BusyMeter:
    """Wall time during which at least one call to a stage was running."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._active = 0
        self._since = 0.0
        self._busy = 0.0

    @contextmanager
    def track(self) -> Iterator[None]:
        if self._active == 0:
            self._since = self._clock()
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._busy += self._clock() - self._since

    @property
    def active(self) -> int:
        return self._active

    def busy_seconds(self, now: float) -> float:
        return self._busy + (now - self._since if self._active else 0.0)


async def resolve(value: Any) -> Any:
    """Await ``value`` if it is awaitable: the data plane may be sync or async."""
    return await value if inspect.isawaitable(value) else value


class RunState:
    def __init__(self, settings: RunSettings, stages: StageHandles, dataplane: Any, clock: Callable[[], float]):
        self.settings = settings
        self.stages = stages
        self.dataplane = dataplane
        self.clock = clock
        self.buffer = ReplayBuffer(settings.buffer_capacity)
        self.sampler = StalenessSampler(settings)
        self.ledger = Ledger()
        self.changed = Notifier()
        self.trainer_version = 0
        self.generator_version = 0
        self.batch_index = 0  # the open step's index, aborted attempts reuse it
        self.consumed_in_step = 0
        self.finished_steps = 0
        self.groups_dispatched = 0
        self.generating = 0  # groups inside a generate call
        self.sync_pending = False  # the sync pump holds dispatch to drain generation
        self.pushing = False  # weights are being read from the trainer
        self.generators_asleep = False  # colocated: the trainer has the GPUs
        self.prompts_exhausted = False
        self.training_done = False
        self.stop_requested = False  # Ctrl-C: end the open step and stop cleanly
        self.pending_clear: list[str] = []  # dropped keys, cleared with the next step
        self.last_error: dict[str, str] = {}
        self.started_at = self.last_progress = clock()
        self._meters: dict[str, BusyMeter] = {}

    def progress(self) -> None:
        self.last_progress = self.clock()
        self.changed.notify()

    def meter(self, stage: str) -> BusyMeter:
        return self._meters.setdefault(stage, BusyMeter(self.clock))

    def active_calls(self) -> dict[str, int]:
        """Calls in flight now, per stage (0: idle)."""
        return {name: m.active for name, m in sorted(self._meters.items())}

    def busy_fractions(self) -> dict[str, float]:
        now = self.clock()
        elapsed = max(now - self.started_at, 1e-9)
        return {name: round(m.busy_seconds(now) / elapsed, 4) for name, m in sorted(self._meters.items())}

    def train_progress(self) -> TrainProgress:
        return TrainProgress(self.trainer_version, self.batch_index, self.consumed_in_step, self.finished_steps)

    def drop(self, group: Group, reason: str, error: BaseException | None = None, pump: str = "rollout") -> None:
        """Drop a whole group: its slot frees now, its keys go with the next clear."""
        self.ledger.dropped(group.keys, reason)
        self.buffer.release(group.group_id)
        self.pending_clear.extend(group.keys)
        if error is not None:
            self.last_error[pump] = f"{reason}: {error!r}"
        self.changed.notify()

    def take_pending_clear(self) -> list[str]:
        keys, self.pending_clear = self.pending_clear, []
        return keys

    async def put(self, keys: Sequence[str], fields: dict) -> None:
        await resolve(self.dataplane.put(list(keys), self.settings.pipeline, fields, None))

    async def clear(self, keys: Sequence[str]) -> None:
        if keys:
            await resolve(self.dataplane.clear(list(keys), self.settings.pipeline))
