"""The state the controller's pumps share.

Everything runs on one asyncio loop, so the state needs no locks: a pump
reads and mutates it between awaits and calls ``changed.notify()``; every
waiting pump then wakes and re-checks its own condition.
"""

from __future__ import annotations

import asyncio
import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from rldsl.runtime.control.buffer import Group, ReplayBuffer
from rldsl.runtime.control.decode_rate import DecodeRate
from rldsl.runtime.control.handles import StageHandles
from rldsl.runtime.control.journal import Journal
from rldsl.runtime.control.leases import LeaseClient
from rldsl.runtime.control.ledger import Ledger
from rldsl.runtime.control.sampler import StalenessSampler, TrainProgress
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.protocols import logprob_field


class Notifier:
    """Wakes every waiter on each state change; waiters re-check themselves."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()

    def next_change(self) -> asyncio.Event:
        """The event the next ``notify`` sets, taken now: a change made
        before the caller gets round to waiting is not missed."""
        return self._event


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


@dataclass
class GeneratorReplica:
    """The controller's view of one generator replica."""

    index: int
    version: int  # the newest weights it has (staged or swapped in): groups dispatched now get them
    concurrency: int  # prompt groups it may hold at once
    shares_trainer_gpus: bool  # sleeps while a step trains
    in_flight: int = 0  # groups inside a generate call on it
    asleep: bool = False
    receiving: bool = False  # a push to it is in transit
    lost: bool = False  # its actor died and could not be replaced: it takes no more groups or pushes
    leased: bool = False  # on GPUs shared with other pipelines: awake only while it holds their lease
    yielding: bool = False  # its lease was asked back: it takes no new groups, then sleeps

    def can_take(self, draining_sleepers: bool) -> bool:
        if self.lost or self.asleep or self.yielding or self.in_flight >= self.concurrency:
            return False
        return not (draining_sleepers and self.shares_trainer_gpus)


class RunState:
    def __init__(self, settings: RunSettings, stages: StageHandles, dataplane: Any, clock: Callable[[], float],
                 journal: Journal | None = None, leases: LeaseClient | None = None):
        self.settings = settings
        self.stages = stages
        self.leases = leases  # the GPU lease scheduler's client when the pipeline shares GPUs with others
        self.dataplane = dataplane
        self.clock = clock
        self.buffer = ReplayBuffer(settings.buffer_capacity)
        self.sampler = StalenessSampler(settings)
        self.journal = journal if journal is not None else Journal()
        self.ledger = Ledger(self.journal)
        self.changed = Notifier()
        self.trainer_version = 0
        self.batch_index = 0  # the open step's index, aborted attempts reuse it
        self.consumed_in_step = 0
        self.finished_steps = 0
        self.groups_dispatched = 0
        self.replicas: list[GeneratorReplica] = []  # set when the run starts (Controller.run)
        self.draining_sleepers = False  # the open step is covered: replicas that will sleep take no more groups
        self.trainer_resident = False  # the trainer was woken onto its GPUs for a step (it takes turns)
        self.lease_wait_s = 0.0  # time the trainer and the replicas waited for GPU leases, added up
        self.exported_version = 0  # the newest version in the host bucket cache
        self.receivers_version = 0  # the newest version pushed to the weight receivers besides generators
        self.receivers_incoming = 0  # the newest version a push to them has started with
        self.prompts_exhausted = False
        self.training_done = False
        self.stop_requested = False  # Ctrl-C: end the open step and stop cleanly
        self.pending_clear: list[str] = []  # dropped keys, cleared with the next step
        self.last_error: dict[str, str] = {}
        self.started_at = self.last_progress = clock()
        self._meters: dict[str, BusyMeter] = {}
        self.decode_rate = DecodeRate()  # the generators' measured rate: the watchdog's stall time scales with it

    def start_replicas(self, count: int, version: int) -> None:
        concurrency = self.settings.replica_concurrency(count)
        sleeping = set(self.settings.sleeping_replicas)
        self.replicas = [GeneratorReplica(i, version, concurrency, i in sleeping,
                                          leased=bool(self.settings.replica_lease(i))) for i in range(count)]
        self.exported_version = self.receivers_version = self.receivers_incoming = version

    @property
    def generating(self) -> int:
        """Groups inside a generate call, all replicas together."""
        return sum(replica.in_flight for replica in self.replicas)

    @property
    def generator_version(self) -> int:
        """The oldest weights an awake replica serves (all replicas when none is awake)."""
        awake = [r.version for r in self.replicas if not r.asleep] or [r.version for r in self.replicas]
        return min(awake, default=self.trainer_version)

    def sleepers(self) -> list[GeneratorReplica]:
        """The replicas the train pump puts to sleep for a step (a leased one
        gives its GPU back through its lease instead)."""
        return [r for r in self.replicas if r.shares_trainer_gpus and not r.lost and not r.leased]

    async def acquire_lease(self, holder: str, gpus: Sequence[str], kind: str) -> None:
        """Wait for a GPU lease; the wait counts in ``lease_wait_s``."""
        asked = self.clock()
        await self.leases.acquire(holder, gpus, kind)
        self.lease_wait_s += self.clock() - asked

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

    def lose_replica(self, lost: Exception) -> None:
        """A generator replica whose actor could not be replaced takes no more
        work; the run goes on with the others (the watchdog speaks if none is left)."""
        replica = getattr(lost, "replica", None)
        self.last_error["rollout"] = str(lost)
        if replica is not None and not self.replicas[replica].lost:
            self.replicas[replica].lost = True
            self.changed.notify()

    def journal_logprob(self, keys: Sequence[str], stage: str, receivers_at_call: int,
                        reported: int | None = None, batch_start: bool = False) -> None:
        """Journal a logprob stage's write. A frozen reference never changes
        weights; a policy stage scored with the version it ``reported``
        (the Ray workers do), or else with the receivers' weights, known
        exactly unless a push was in transit during the call: then they lie
        between the version they had when it was asked for and the newest
        pushed since. ``batch_start``: the train pump asked for the
        trainer's version, ``receivers_at_call``."""
        if stage not in self.settings.policy_logprob_stages:
            self.journal.logprob(keys, stage, logprob_field(frozen=True), None)
            return
        if reported is not None or batch_start:
            version = receivers_at_call if reported is None else reported
            self.journal.logprob(keys, stage, logprob_field(frozen=False), (version, version), batch_start)
            return
        newest = max(self.receivers_version, self.receivers_incoming)
        self.journal.logprob(keys, stage, logprob_field(frozen=False), (receivers_at_call, newest))

    def take_pending_clear(self) -> list[str]:
        keys, self.pending_clear = self.pending_clear, []
        return keys

    async def put(self, keys: Sequence[str], fields: dict) -> None:
        await self._dataplane_call("put", list(keys), self.settings.pipeline, fields, None)

    async def clear(self, keys: Sequence[str]) -> None:
        if keys:
            await self._dataplane_call("clear", list(keys), self.settings.pipeline)

    async def _dataplane_call(self, method: str, *args: Any) -> Any:
        """A data plane that blocks (a network client) runs in a thread, so
        the pumps keep moving while it waits; an in-memory one is called directly."""
        call = getattr(self.dataplane, method)
        if getattr(self.dataplane, "blocking", False):
            return await asyncio.to_thread(call, *args)
        return await resolve(call(*args))
