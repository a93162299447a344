"""The lease pump: generator replicas on GPUs shared with other pipelines
serve only while they hold those GPUs' lease (leases.py).

The pipeline's generator set shrinks and expands at run time:

- expand: while the rollout pump has groups it could dispatch, every
  sleeping leased replica asks for its lease; once granted it wakes and is
  refreshed from the host bucket cache to the newest exported version
  before it takes a group;
- shrink: a replica whose lease is asked back takes no new groups; once its
  groups are done and no push is in transit to it (its weights are one
  version, whole), it sleeps, and only then is the lease given back;
- a replica with nothing to do tells the scheduler it is idle, so another
  pipeline that waits for its GPU gets it at once.

A request no longer needed (the rollout pump has nothing to dispatch) is
withdrawn. When the run ends, however it ends, every replica sleeps and
every lease goes back (planned shrink to zero).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable

from rldsl.runtime.control.errors import WorkerLost
from rldsl.runtime.control.leases import GENERATE, LeaseWithdrawn
from rldsl.runtime.control.state import GeneratorReplica, RunState

_SHRINK_TIMEOUT_S = 60.0


def replica_holder(index: int) -> str:
    """A generator replica's name with the lease scheduler."""
    return f"rollout[{index}]"


class LeasePump:
    def __init__(self, state: RunState, wants_capacity: Callable[[], bool]) -> None:
        self.state, self.wants_capacity = state, wants_capacity
        self.leases = state.leases
        self._asking: dict[int, asyncio.Task] = {}  # replica -> its acquire-then-wake
        self._held: set[int] = set()  # replicas granted their lease (waking, awake or going to sleep)
        self._yielding: dict[int, asyncio.Task] = {}  # replica -> its sleep-then-release
        self._idle: dict[int, bool] = {}
        self._revoked: set[str] = set()
        self._failure: BaseException | None = None  # a lease call or a sleep/wake that failed: the run stops
        self.phase = "idle"

    @property
    def replicas(self) -> list[GeneratorReplica]:
        return [r for r in self.state.replicas if r.leased]

    async def start(self) -> None:
        """Leased replicas start asleep, holding no GPU memory and no lease."""
        replicas = self.replicas
        for replica in replicas:
            replica.asleep = True
        if replicas:
            await self.state.stages.sleep_generators([r.index for r in replicas])

    async def run(self) -> None:
        state = self.state
        watcher = asyncio.create_task(self._watch_revocations(), name="lease revocations")
        try:
            while not state.training_done:
                change = state.changed.next_change()
                self._reconcile()
                self.phase = self._describe()
                changed = asyncio.create_task(change.wait())
                await asyncio.wait({changed, watcher}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if watcher.done():
                    watcher.result()  # the scheduler was lost: the run stops, named
                if self._failure is not None:
                    raise self._failure
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    def _reconcile(self) -> None:
        demand = self.wants_capacity()
        for replica in self.replicas:
            index = replica.index
            if index in self._yielding:
                continue
            if replica.lost:
                if index in self._held:  # gone, and holding no memory: its GPU is free
                    self._held.discard(index)
                    self._spawn(self.leases.release(replica_holder(index)))
                continue
            if replica.asleep:
                asking = self._asking.get(index)
                if demand and asking is None and index not in self._held:
                    self._asking[index] = self._spawn(self._expand(replica))
                elif not demand and asking is not None and index not in self._held:
                    asking.cancel()  # withdrawn while still waiting for the grant
                continue
            if replica_holder(index) in self._revoked:
                replica.yielding = True
                if replica.in_flight == 0 and not replica.receiving:
                    self._yielding[index] = self._spawn(self._shrink(replica))
                continue
            idle = replica.in_flight == 0 and not (demand and replica.can_take(self.state.draining_sleepers))
            if self._idle.get(index) != idle:
                self._idle[index] = idle
                self._spawn(self.leases.set_idle(replica_holder(index), idle))

    async def _expand(self, replica: GeneratorReplica) -> None:
        state, holder = self.state, replica_holder(replica.index)
        try:
            try:
                await state.acquire_lease(holder, state.settings.replica_lease(replica.index), GENERATE)
            except asyncio.CancelledError:  # withdraw, or give back a grant that crossed the withdrawal
                await asyncio.shield(self.leases.release(holder))
                raise
            self._held.add(replica.index)
            version = state.exported_version
            try:
                await state.stages.wake_generators([replica.index], version)
            except WorkerLost as lost:
                state.lose_replica(lost)
                return  # _reconcile gives the lost replica's lease back
            replica.version = max(replica.version, version)
            replica.asleep = replica.yielding = False
            self._idle.pop(replica.index, None)
        except LeaseWithdrawn:
            pass
        finally:
            self._asking.pop(replica.index, None)
            state.progress()

    async def _shrink(self, replica: GeneratorReplica) -> None:
        """Sleep, then give the lease back: the GPU is free only once the memory is."""
        state, holder = self.state, replica_holder(replica.index)
        replica.asleep = True
        try:
            await state.stages.sleep_generators([replica.index])
        except WorkerLost as lost:  # a replica that is gone holds no GPU memory either
            state.lose_replica(lost)
        await self.leases.release(holder)
        self._held.discard(replica.index)
        self._revoked.discard(holder)
        replica.yielding = False
        self._idle.pop(replica.index, None)
        self._yielding.pop(replica.index, None)
        state.changed.notify()

    async def _watch_revocations(self) -> None:
        seen = 0
        while True:
            seen, revoked = await self.leases.revoked(seen)
            self._revoked = set(revoked)
            self.state.changed.notify()

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        task.add_done_callback(self._surface)
        return task

    def _surface(self, task: asyncio.Task) -> None:
        """A lease call, sleep or wake that failed stops the run: a replica
        whose memory may not be released must not give its GPU back."""
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            self.state.changed.notify()

    async def shrink_to_zero(self) -> None:
        """The run ended: every replica sleeps and every lease goes back.
        Best effort within a bound: a dead actor holds no memory, and the
        scheduler forgets the pipeline's leases whatever happens here."""
        for task in list(self._asking.values()):
            task.cancel()
        state = self.state
        awake = [r.index for r in self.replicas if not r.asleep and not r.lost]
        with contextlib.suppress(Exception):
            if awake:
                await asyncio.wait_for(state.stages.sleep_generators(awake), _SHRINK_TIMEOUT_S)
        with contextlib.suppress(Exception):
            if state.trainer_resident:
                await asyncio.wait_for(state.stages.sleep_trainer(), _SHRINK_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.leases.finish(), _SHRINK_TIMEOUT_S)

    def _describe(self) -> str:
        awake = [r.index for r in self.replicas if not r.asleep]
        parts = [f"{len(awake)}/{len(self.replicas)} leased replicas awake"]
        if self._asking:
            parts.append(f"waiting for leases of replicas {', '.join(map(str, sorted(self._asking)))}")
        if self._yielding:
            parts.append(f"giving back replicas {', '.join(map(str, sorted(self._yielding)))}")
        return "; ".join(parts)

    def awake_replicas(self) -> int:
        return sum(1 for r in self.replicas if not r.asleep)
