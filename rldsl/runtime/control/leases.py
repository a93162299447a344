"""GPU leases across pipelines: who may use a shared GPU, when.

Pipelines that share GPUs take turns on them. A ``LeaseScheduler`` (one per
cluster; the Ray lowering hosts it in one actor) owns a lease per shared
GPU. A pipeline's controller asks for a lease before a phase puts state on a
GPU (a generator replica waking, a train step) and gives it back once that
phase has released its memory, so at most one GPU-resident phase holds a GPU
at any time.

Policy, in order:

1. train requests before generation requests: a trainer never waits behind
   another pipeline's generation longer than that replica's batch in flight;
2. a pipeline of higher ``priority`` before a lower one;
3. among equals, the pipeline with the fewest GPU-seconds held per unit of
   ``weight`` (weighted fair share), then the older request.

A GPU wanted by a request earlier in that order is not granted to a later
one, so multi-GPU trainers are not starved by single-GPU replicas. A request
blocked by a generation lease asks its holder to give it back (a
revocation) when the holder is idle, when the request is a train request,
or when the requester is ahead in the order and the holder has had its GPU
for at least ``quantum_s``. Train leases are never revoked: a step runs to
its end. Every operation is idempotent: acquiring a held lease returns at
once, releasing a free one does nothing, a second acquire of a pending
request waits for the same grant.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

TRAIN, GENERATE = "train", "generate"
_KIND_RANK = {TRAIN: 0, GENERATE: 1}


class LeaseClient(Protocol):
    """What a pipeline's controller calls; one client per pipeline."""

    async def acquire(self, holder: str, gpus: Sequence[str], kind: str) -> None: ...

    async def release(self, holder: str) -> None: ...

    async def set_idle(self, holder: str, idle: bool) -> None: ...

    async def revoked(self, seen: int) -> tuple[int, list[str]]: ...

    async def finish(self) -> None: ...


@dataclass
class _Share:
    weight: float = 1.0
    priority: int = 0
    used: float = 0.0  # GPU-seconds of leases already given back
    waited: float = 0.0  # GPU-seconds of requests waiting before their grant
    waits: int = 0  # requests that had to wait
    grants: int = 0
    revocations: int = 0
    revoked: set[str] = field(default_factory=set)  # holders asked to give their lease back
    revoked_seq: int = 0
    changed: asyncio.Event | None = None
    finished: bool = False


@dataclass
class _Lease:
    pipeline: str
    holder: str
    gpus: tuple[str, ...]
    kind: str
    since: float
    idle: bool = False


@dataclass
class _Request:
    pipeline: str
    holder: str
    gpus: tuple[str, ...]
    kind: str
    asked_at: float
    seq: int
    granted: asyncio.Future


class LeaseError(RuntimeError):
    """A request the scheduler cannot take: an unknown pipeline or GPU."""


class LeaseScheduler:
    """``gpus``: the shared GPUs it governs, as ``"node:gpu"`` ids."""

    def __init__(self, gpus: Iterable[str], quantum_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 tick_s: float = 0.05) -> None:
        self.gpus = frozenset(gpus)
        self.quantum_s, self.clock, self.tick_s = quantum_s, clock, tick_s
        self.shares: dict[str, _Share] = {}
        self.leases: dict[tuple[str, str], _Lease] = {}
        self.holder_of: dict[str, _Lease] = {}  # gpu -> its lease
        self.pending: dict[tuple[str, str], _Request] = {}
        self.history: list[tuple[str, str, str, float, float]] = []  # (gpu, pipeline, holder, from, to)
        self._seq = 0
        self._scheduled_at = float("-inf")

    def register(self, pipeline: str, weight: float = 1.0, priority: int = 0) -> None:
        if weight <= 0:
            raise LeaseError(f"pipeline `{pipeline}`: weight must be > 0, got {weight}")
        share = self.shares.setdefault(pipeline, _Share())
        share.weight, share.priority, share.finished = weight, priority, False

    async def acquire(self, pipeline: str, holder: str, gpus: Sequence[str], kind: str) -> None:
        """Wait until ``holder`` of ``pipeline`` holds every GPU of ``gpus``."""
        key = (pipeline, holder)
        if key in self.leases:
            return
        request = self.pending.get(key)
        if request is None:
            request = self._request(pipeline, holder, gpus, kind)
            self.schedule()
        while not request.granted.done():
            try:
                await asyncio.wait_for(asyncio.shield(request.granted), self.tick_s)
            except asyncio.TimeoutError:  # fair shares move as leases are held: re-evaluated once a tick,
                if self.clock() - self._scheduled_at >= self.tick_s:  # however many wait
                    self.schedule()
        request.granted.result()  # raises when the request was withdrawn

    def release(self, pipeline: str, holder: str) -> None:
        """Give back a lease, or withdraw a request still waiting."""
        key = (pipeline, holder)
        request = self.pending.pop(key, None)
        if request is not None and not request.granted.done():
            request.granted.set_exception(LeaseWithdrawn(f"{pipeline}/{holder}: request withdrawn"))
            request.granted.exception()  # retrieved: nobody may be awaiting it
        lease = self.leases.pop(key, None)
        if lease is not None:
            now = self.clock()
            share = self.shares[pipeline]
            share.used += (now - lease.since) * len(lease.gpus)
            for gpu in lease.gpus:
                del self.holder_of[gpu]
                self.history.append((gpu, pipeline, holder, lease.since, now))
        share = self.shares.get(pipeline)
        if share is not None and holder in share.revoked:
            share.revoked.discard(holder)
            self._signal(share)
        self.schedule()

    def set_idle(self, pipeline: str, holder: str, idle: bool) -> None:
        lease = self.leases.get((pipeline, holder))
        if lease is not None and lease.idle != idle:
            lease.idle = idle
            if idle:
                self.schedule()

    async def revoked(self, pipeline: str, seen: int) -> tuple[int, list[str]]:
        """Long poll: the holders ``pipeline`` is asked to give back, once the
        set has changed since sequence number ``seen``."""
        share = self._share(pipeline)
        while share.revoked_seq <= seen and not share.finished:
            share.changed = share.changed or asyncio.Event()
            await share.changed.wait()
        return share.revoked_seq, sorted(share.revoked)

    def finish(self, pipeline: str) -> None:
        """The pipeline ended (finished or failed): every lease and request of
        it goes, and the others continue (planned shrink to zero)."""
        for pipe, holder in [key for key in [*self.pending, *self.leases] if key[0] == pipeline]:
            self.release(pipe, holder)
        share = self._share(pipeline)
        share.finished = True
        self._signal(share)

    def stats(self, pipeline: str) -> dict:
        share, now = self._share(pipeline), self.clock()
        waiting = sum((now - r.asked_at) * len(r.gpus) for r in self.pending.values() if r.pipeline == pipeline)
        return {"gpu_seconds_used": round(self._usage(pipeline), 3), "gpu_seconds_waited": round(share.waited + waiting, 3),
                "lease_waits": share.waits, "grants": share.grants, "revocations": share.revocations,
                "weight": share.weight, "priority": share.priority,
                "holding": sorted(lease.holder for lease in self.leases.values() if lease.pipeline == pipeline)}

    def schedule(self) -> None:
        """Grant what can be granted, in policy order; ask back what blocks."""
        self._scheduled_at = self.clock()
        claimed: set[str] = set()
        for request in sorted(self.pending.values(), key=self._order):
            busy = [gpu for gpu in request.gpus if gpu in self.holder_of]
            if not busy and not claimed.intersection(request.gpus):
                self._grant(request)
                continue
            claimed.update(request.gpus)
            for lease in {id(self.holder_of[gpu]): self.holder_of[gpu] for gpu in busy}.values():
                if self._should_revoke(request, lease):
                    self._revoke(lease)

    def _request(self, pipeline: str, holder: str, gpus: Sequence[str], kind: str) -> _Request:
        if pipeline not in self.shares or self.shares[pipeline].finished:
            raise LeaseError(f"pipeline `{pipeline}` is not registered with the GPU scheduler")
        unknown = sorted(set(gpus) - self.gpus)
        if unknown or not gpus:
            raise LeaseError(f"{pipeline}/{holder}: GPUs {unknown or '(none)'} are not governed by the GPU scheduler")
        if kind not in _KIND_RANK:
            raise LeaseError(f"{pipeline}/{holder}: unknown lease kind {kind!r}")
        self._seq += 1
        request = _Request(pipeline, holder, tuple(sorted(set(gpus))), kind, self.clock(), self._seq,
                           asyncio.get_running_loop().create_future())
        self.pending[(pipeline, holder)] = request
        return request

    def _order(self, request: _Request) -> tuple:
        share = self.shares[request.pipeline]
        return (_KIND_RANK[request.kind], -share.priority, self._usage(request.pipeline) / share.weight, request.seq)

    def _usage(self, pipeline: str) -> float:
        now = self.clock()
        return self.shares[pipeline].used + sum((now - lease.since) * len(lease.gpus)
                                                for lease in self.leases.values() if lease.pipeline == pipeline)

    def _should_revoke(self, request: _Request, lease: _Lease) -> bool:
        if lease.kind == TRAIN or (lease.pipeline, lease.holder) == (request.pipeline, request.holder):
            return False
        if lease.idle or request.kind == TRAIN:
            return True
        if lease.pipeline == request.pipeline or self.clock() - lease.since < self.quantum_s:
            return False
        holder_share, share = self.shares[lease.pipeline], self.shares[request.pipeline]
        return (-share.priority, self._usage(request.pipeline) / share.weight) < \
            (-holder_share.priority, self._usage(lease.pipeline) / holder_share.weight)

    def _grant(self, request: _Request) -> None:
        now = self.clock()
        del self.pending[(request.pipeline, request.holder)]
        lease = _Lease(request.pipeline, request.holder, request.gpus, request.kind, now)
        for gpu in lease.gpus:
            if gpu in self.holder_of:  # the one invariant: a GPU has one holder
                raise AssertionError(f"GPU {gpu} granted to {request.holder} while "
                                     f"{self.holder_of[gpu].holder} holds it")
            self.holder_of[gpu] = lease
        self.leases[(request.pipeline, request.holder)] = lease
        share = self.shares[request.pipeline]
        share.grants += 1
        if now - request.asked_at > 1e-3:  # granted at once is no wait
            share.waits += 1
            share.waited += (now - request.asked_at) * len(request.gpus)
        request.granted.set_result(None)

    def _revoke(self, lease: _Lease) -> None:
        share = self.shares[lease.pipeline]
        if lease.holder not in share.revoked:
            share.revoked.add(lease.holder)
            share.revocations += 1
            self._signal(share)

    def _signal(self, share: _Share) -> None:
        share.revoked_seq += 1
        if share.changed is not None:
            share.changed.set()
            share.changed = None

    def _share(self, pipeline: str) -> _Share:
        if pipeline not in self.shares:
            raise LeaseError(f"pipeline `{pipeline}` is not registered with the GPU scheduler")
        return self.shares[pipeline]


class LeaseWithdrawn(RuntimeError):
    """The request was released before it was granted."""


class LocalLeases:
    """A ``LeaseClient`` over a scheduler on the same event loop (tests, benchmarks)."""

    def __init__(self, scheduler: LeaseScheduler, pipeline: str) -> None:
        self.scheduler, self.pipeline = scheduler, pipeline

    async def acquire(self, holder: str, gpus: Sequence[str], kind: str) -> None:
        await self.scheduler.acquire(self.pipeline, holder, gpus, kind)

    async def release(self, holder: str) -> None:
        self.scheduler.release(self.pipeline, holder)

    async def set_idle(self, holder: str, idle: bool) -> None:
        self.scheduler.set_idle(self.pipeline, holder, idle)

    async def revoked(self, seen: int) -> tuple[int, list[str]]:
        return await self.scheduler.revoked(self.pipeline, seen)

    async def finish(self) -> None:
        self.scheduler.finish(self.pipeline)
