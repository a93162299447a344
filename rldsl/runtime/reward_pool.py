"""Reward functions in child processes, so that no reward can take a worker down.

A ``RewardPool`` owns a few reward processes (reward_process.py), each a
fresh interpreter that imports the function once. A call's samples are split
into one chunk per process and scored in parallel; several threads may call
at once, their chunks queue in order. The process answers every sample as
soon as it is scored, which gives each sample its own deadline: when no
answer comes within ``timeout_s`` the running sample is the hung one, so its
process is killed (SIGKILL, which stops it burning CPU), that sample alone
is dropped as ``reward_timeout``, the rest of its chunk goes back to the
front of the queue and a new process takes the old one's place. A process
that dies (a segfault, ``os._exit``) drops its running sample the same way,
as ``reward_raised``, with or without a timeout. A sample that runs long
while other work waits is handed off (reward_child.py) well before its
deadline, so that a hang costs its own sample and not a slot's throughput.
With a ``straggler`` factor, a sample's deadline comes sooner: that many
times the usual time per sample (at least ``STRAGGLER_FLOOR_S``), dropped
as ``reward_straggler``, so that a hang costs its call about that long.
With a deadline the pool keeps one spare process ready, so that a slot
that lost its process to a deadline goes on at once, not after a new
process's start.

Why ``subprocess`` with two pipes and not ``multiprocessing``:
``ProcessPoolExecutor`` cannot kill one hung task (only break the whole
pool), and ``multiprocessing``'s ``spawn``/``forkserver`` re-run the parent's
``__main__`` in the child, which in a Ray actor is Ray's worker script (it
imports Ray: 0.7 s per process on a 2-core machine). A child started with
``subprocess`` inherits nothing of the worker but its environment and
``sys.path``, is ready in about 0.1 s, and is killed and reaped with the
plain process API.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from rldsl.rewards import RewardLoadError
from rldsl.runtime.control.ledger import REWARD_RAISED
from rldsl.runtime.protocols import RewardFailure
from rldsl.runtime.reward_child import (
    DIED,
    STARTUP_TIMEOUT_S,
    TIMED_OUT,
    RewardChild,
    reply_result,
    straggler_failure,
    timeout_failure,
    watch_handed_off,
)
from rldsl.runtime.reward_process import describe_spec

DEFAULT_PROCESSES = 2  # per worker: a hung sample blocks one, the other keeps scoring
HAND_OFF_SHARE = 0.1  # of the timeout a sample may run while work waits, before its slot hands it off
HAND_OFF_SLOWER_THAN = 8  # ... and never before 8x the reward's usual time per sample
HANDED_OFF_PER_PROCESS = 2  # handed-off processes waiting out their deadline, per pool process at most
_POLL_S = 0.05  # how often a slot whose sample runs long looks for waiting work
STRAGGLER_FLOOR_S = 0.1  # never taken for hung sooner: a sample timed in its own process, jitter is small
STRAGGLER_AFTER_SAMPLES = 16  # samples scored before their usual time is trusted

_HANDED_OFF = object()

Sample = tuple[str, str, str]  # (response, answer, prompt)


class RewardPool:
    """``score(samples)`` -> one float or ``RewardFailure`` per sample (a
    ``ComponentReward``, a float with its parts, for named components).

    Processes start at construction (in the background: the constructor
    returns at once); ``wait_ready`` waits for them and raises
    ``RewardLoadError`` when the function does not import.
    """

    def __init__(self, fn_spec: str | list, processes: int = DEFAULT_PROCESSES, timeout_s: float | None = None,
                 straggler: float = 0.0):
        self.fn_spec = fn_spec
        self.timeout_s = timeout_s or None  # 0 or None: no deadline, crashes are still isolated
        self.straggler = straggler  # 0: a sample runs until its timeout
        self._samples_timed = 0
        self._queue = _ChunkQueue()
        self._handed_off: set[RewardChild] = set()  # processes a slot gave up, waiting out their deadline
        self._handed_off_lock = threading.Lock()
        self._sample_s: float | None = None  # the usual time per sample (a moving average)
        self._spare_lock = threading.Lock()
        self._spare: RewardChild | None = None
        self._slots = [_Slot(self, index) for index in range(max(1, processes))]
        if self.timeout_s or straggler:  # deadlines replace processes: one waits ready
            self._start_spare()
        atexit.register(self.close)

    @property
    def processes(self) -> int:
        return len(self._slots)

    def process_ids(self) -> list[int]:
        """The processes running now (for diagnostics and tests)."""
        children = [slot.child for slot in self._slots]  # read once: a slot may replace its own meanwhile
        return [child.process.pid for child in children if child is not None]

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for slot in self._slots:
            if not slot.started.wait(max(0.0, deadline - time.monotonic())):
                raise RewardLoadError(f"reward {describe_spec(self.fn_spec)}: its process did not start within "
                                      f"{timeout_s:g}s")
            if slot.start_error:
                raise slot.start_error

    def score(self, samples: Sequence[Sample]) -> list[float | RewardFailure]:
        call = _Call(len(samples))
        if samples and not self._queue.put(_split(call, list(samples), len(self._slots))):
            raise RuntimeError("the reward pool is closed")
        return call.wait()

    def new_child(self) -> RewardChild:
        """A process for a slot: the spare (importing since it started), replaced in turn; else a new one."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is None:
            return RewardChild(self.fn_spec)
        self._start_spare()
        return spare

    def _start_spare(self) -> None:
        with self._spare_lock:
            if self._spare is None and not self._queue.closed:
                with contextlib.suppress(OSError):  # then the next slot that needs one starts its own
                    self._spare = RewardChild(self.fn_spec)

    def close(self) -> None:
        """Stop every process; calls still queued fail their samples."""
        atexit.unregister(self.close)
        for chunk in self._queue.close():
            chunk.fail_all(RewardFailure(REWARD_RAISED, "the reward pool closed"))
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.kill()
        for slot in self._slots:
            slot.interrupt()
        with self._handed_off_lock:
            for child in self._handed_off:
                child.signal_kill()
        for slot in self._slots:
            slot.thread.join(timeout=5.0)

    def hand_off_after(self) -> float | None:
        """How long a sample may run, while other work waits, before its slot
        hands its process off (None: never, without a timeout)."""
        if self.timeout_s is None:
            return None
        usual = HAND_OFF_SLOWER_THAN * (self._sample_s or 0.0)
        return min(max(HAND_OFF_SHARE * self.timeout_s, usual), self.timeout_s / 2)

    def sample_limit(self) -> tuple[float | None, RewardFailure | None]:
        """How long a sample may run now (None: no limit), and its failure past that."""
        cut = None
        if self.straggler and self._samples_timed >= STRAGGLER_AFTER_SAMPLES:
            cut = max(STRAGGLER_FLOOR_S, self.straggler * self._sample_s)
        if cut is not None and (self.timeout_s is None or cut < self.timeout_s):
            return cut, straggler_failure(cut, self.straggler)
        return self.timeout_s, None if self.timeout_s is None else timeout_failure(self.timeout_s)

    def hand_off(self, child: RewardChild, deadline: float, overran: RewardFailure, record) -> bool:
        """Take over a process whose sample runs long, so that its slot can go
        on; False when as many are handed off as the pool allows (each may
        hold a CPU until its deadline)."""
        with self._handed_off_lock:
            if self._queue.closed or len(self._handed_off) >= HANDED_OFF_PER_PROCESS * len(self._slots):
                return False
            self._handed_off.add(child)
        watch_handed_off(child, deadline, overran, record, self._handed_off_ended)
        return True

    def _handed_off_ended(self, child: RewardChild) -> None:
        with self._handed_off_lock:
            self._handed_off.discard(child)

    def handed_off_count(self) -> int:
        with self._handed_off_lock:
            return len(self._handed_off)

    def note_sample_time(self, seconds: float) -> None:
        self._sample_s = seconds if self._sample_s is None else 0.9 * self._sample_s + 0.1 * seconds
        self._samples_timed += 1

    def work_waiting(self) -> bool:
        return self._queue.waiting

    def requeue(self, chunk: _Chunk) -> None:
        """The unscored rest of a chunk whose process was lost: next in line."""
        if chunk.indices and not self._queue.put([chunk], front=True):
            chunk.fail_all(RewardFailure(REWARD_RAISED, "the reward pool closed"))


@dataclass
class _Chunk:
    call: _Call
    indices: list[int]  # positions in the call's samples
    samples: list[Sample]

    def rest(self, start: int) -> _Chunk:
        return _Chunk(self.call, self.indices[start:], self.samples[start:])

    def fail_all(self, failure: RewardFailure) -> None:
        for index in self.indices:
            self.call.record(index, failure)


def _split(call: _Call, samples: list[Sample], parts: int) -> list[_Chunk]:
    """Contiguous chunks of near-equal size, at most ``parts`` of them."""
    parts = min(parts, len(samples))
    bounds = [len(samples) * part // parts for part in range(parts + 1)]
    return [_Chunk(call, list(range(a, b)), samples[a:b]) for a, b in itertools.pairwise(bounds)]


class _Call:
    """The results of one ``score`` call, filled in by the slots in any order."""

    def __init__(self, size: int):
        self.results: list = [None] * size
        self.error: Exception | None = None
        self._left = size
        self._lock = threading.Lock()
        self._done = threading.Event()
        if size == 0:
            self._done.set()

    def record(self, index: int, result) -> None:
        with self._lock:
            self.results[index] = result
            self._left -= 1
            finished = self._left == 0
        if finished:
            self._done.set()

    def fail(self, error: Exception) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> list:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.results


class _ChunkQueue:
    def __init__(self):
        self._chunks: deque[_Chunk] = deque()
        self._ready = threading.Condition()
        self._closed = False

    def put(self, chunks: list[_Chunk], front: bool = False) -> bool:
        with self._ready:
            if self._closed:
                return False
            if front:
                self._chunks.extendleft(reversed(chunks))
            else:
                self._chunks.extend(chunks)
            self._ready.notify(len(chunks))
        return True

    def take(self) -> _Chunk | None:
        """The next chunk, waiting for one; None once closed."""
        with self._ready:
            while not self._chunks and not self._closed:
                self._ready.wait()
            return None if self._closed else self._chunks.popleft()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def waiting(self) -> bool:
        return bool(self._chunks)

    def close(self) -> list[_Chunk]:
        with self._ready:
            self._closed = True
            left, self._chunks = list(self._chunks), deque()
            self._ready.notify_all()
        return left


class _Slot:
    """One thread that owns one reward process at a time and feeds it chunks."""

    def __init__(self, pool: RewardPool, index: int):
        self.pool = pool
        self.child: RewardChild | None = None
        self.start_error: RewardLoadError | None = None
        self.started = threading.Event()  # the first process answered (ready or not)
        self.thread = threading.Thread(target=self._serve, daemon=True, name=f"reward-process-{index}")
        self.thread.start()

    def _serve(self) -> None:
        try:
            self._live_child()
        except RewardLoadError as error:
            self.start_error = error
        finally:
            self.started.set()
        while (chunk := self.pool._queue.take()) is not None:
            if chunk.call.error is None:
                self._run_guarded(chunk)
        if self.child is not None:
            self.child.kill()

    def _live_child(self) -> RewardChild:
        """The slot's process, started if need be, once it has imported the function."""
        if self.child is None:
            try:
                self.child = RewardChild(self.pool.fn_spec)
            except OSError as error:
                raise RewardLoadError(f"reward {describe_spec(self.pool.fn_spec)}: cannot start a reward process: "
                                      f"{error}") from None
        try:
            self.child.wait_ready()
        except RewardLoadError:
            self.child.kill()
            self.child = None
            raise
        return self.child

    def _run_guarded(self, chunk: _Chunk) -> None:
        """``_run``, failing the call on a fault of this module rather than leaving its caller waiting."""
        try:
            self._run(chunk)
        except Exception as error:  # noqa: BLE001 - the caller raises it; the slot serves on
            chunk.call.fail(error)
            child, self.child = self.child, None
            if child is not None:
                with contextlib.suppress(Exception):
                    child.kill()

    def _run(self, chunk: _Chunk) -> None:
        try:
            child = self._live_child()
        except RewardLoadError as error:
            chunk.call.fail(error)
            return
        if not child.send(chunk.samples):  # it died idle: no sample of this chunk is to blame
            child.reap()
            self._replace_child()
            self.pool.requeue(chunk)
            return
        for position, index in enumerate(chunk.indices):
            reply = self._answer(child, functools.partial(chunk.call.record, index),
                                 more=position + 1 < len(chunk.indices))
            if reply is _HANDED_OFF:  # the process keeps this sample; the rest go to a new one
                self._replace_child()
                self.pool.requeue(chunk.rest(position + 1))
                return
            if isinstance(reply, RewardFailure) or reply is DIED:  # it overran its deadline, or died
                self._lose_child(chunk, position, reply)
                return
            chunk.call.record(index, reply_result(reply))

    def _answer(self, child: RewardChild, record, more: bool = False):
        """The running sample's answer, ``DIED``, or the ``RewardFailure`` of
        its deadline once past it; or ``_HANDED_OFF`` when it ran long while
        other work waited (``more``: the rest of its own chunk) and the pool
        took its process over (``record`` then gets its result later)."""
        limit_s, overran = self.pool.sample_limit()
        if limit_s is None:
            return child.receive(None)
        started = time.monotonic()
        patience = self.pool.hand_off_after()  # a straggler's deadline comes sooner: half of it at most
        patience = limit_s / 2 if patience is None else min(patience, limit_s / 2)
        deadline = started + limit_s
        reply = child.receive(started + patience)
        while reply is TIMED_OUT and time.monotonic() < deadline:
            if (more or self.pool.work_waiting()) and self.pool.hand_off(child, deadline, overran, record):
                self.child = None
                return _HANDED_OFF
            reply = child.receive(min(deadline, time.monotonic() + min(patience, _POLL_S)))
        if reply is TIMED_OUT:
            return overran
        if reply is not DIED:
            self.pool.note_sample_time(time.monotonic() - started)
        return reply

    def _lose_child(self, chunk: _Chunk, position: int, how) -> None:
        """Drop the sample the process was running (``how``: its deadline's
        failure, or ``DIED``), replace the process, requeue the rest."""
        child = self.child
        if how is not DIED:
            results = [reply_result(reply) for reply in child.kill()]  # answers written before the kill count
            if not results:  # else the running sample had not had its full time: it goes again
                results.append(how)
        else:
            results = [RewardFailure(REWARD_RAISED, f"the reward process died ({child.reap()}) scoring this sample")]
        self._replace_child()  # before the results: a caller they complete finds the pool whole
        for result in results[:len(chunk.indices) - position]:
            chunk.call.record(chunk.indices[position], result)
            position += 1
        self.pool.requeue(chunk.rest(position))

    def _replace_child(self) -> None:
        """A new process, importing while the queue refills (none once closing)."""
        self.child = None
        if not self.pool._queue.closed:
            with contextlib.suppress(OSError):  # else the next chunk tries again, and says why
                self.child = self.pool.new_child()

    def interrupt(self) -> None:
        """From another thread: kill the process; this slot's thread sees it die and cleans up."""
        child = self.child
        if child is not None:
            child.signal_kill()
