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
    timeout_failure,
    watch_handed_off,
)
from rldsl.runtime.reward_process import describe_spec

DEFAULT_PROCESSES = 2  # per worker: a hung sample blocks one, the other keeps scoring
HAND_OFF_SHARE = 0.1  # of the timeout a sample may run while work waits, before its slot hands it off
HAND_OFF_SLOWER_THAN = 8  # ... and never before 8x the reward's usual time per sample
HANDED_OFF_PER_PROCESS = 2  # handed-off processes waiting out their deadline, per pool process at most
_POLL_S = 0.05  # how often a slot whose sample runs long looks for waiting work

_HANDED_OFF = object()

Sample = tuple[str, str, str]  # (response, answer, prompt)


class RewardPool:
    """``score(samples)`` -> one float or ``RewardFailure`` per sample (a
    ``ComponentReward``, a float with its parts, for named components).

    Processes start at construction (in the background: the constructor
    returns at once); ``wait_ready`` waits for them and raises
    ``RewardLoadError`` when the function does not import.
    """

    def __init__(self, fn_spec: str | list, processes: int = DEFAULT_PROCESSES, timeout_s: float | None = None):
        self.fn_spec = fn_spec
        self.timeout_s = timeout_s or None  # 0 or None: no deadline, crashes are still isolated
        self._queue = _ChunkQueue()
        self._handed_off: set[RewardChild] = set()  # processes a slot gave up, waiting out their deadline
        self._handed_off_lock = threading.Lock()
        self._sample_s: float | None = None  # the usual time per sample (a moving average)
        self._slots = [_Slot(self, index) for index in range(max(1, processes))]
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

    def close(self) -> None:
        """Stop every process; calls still queued fail their samples."""
        atexit.unregister(self.close)
        for chunk in self._queue.close():
            chunk.fail_all(RewardFailure(REWARD_RAISED, "the reward pool closed"))
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

    def hand_off(self, child: RewardChild, deadline: float, record) -> bool:
        """Take over a process whose sample runs long, so that its slot can go
        on; False when as many are handed off as the pool allows (each may
        hold a CPU until its deadline)."""
        with self._handed_off_lock:
            if self._queue.closed or len(self._handed_off) >= HANDED_OFF_PER_PROCESS * len(self._slots):
                return False
            self._handed_off.add(child)
        watch_handed_off(child, deadline, self.timeout_s, record, self._handed_off_ended)
        return True

    def _handed_off_ended(self, child: RewardChild) -> None:
        with self._handed_off_lock:
            self._handed_off.discard(child)

    def handed_off_count(self) -> int:
        with self._handed_off_lock:
            return len(self._handed_off)

    def note_sample_time(self, seconds: float) -> None:
        self._sample_s = seconds if self._sample_s is None else 0.9 * self._sample_s + 0.1 * seconds

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
            if reply is TIMED_OUT or reply is DIED:
                self._lose_child(chunk, position, reply)
                return
            chunk.call.record(index, reply_result(reply))

    def _answer(self, child: RewardChild, record, more: bool = False):
        """The running sample's answer, ``TIMED_OUT`` or ``DIED``; or
        ``_HANDED_OFF`` when it ran long while other work waited (``more``:
        the rest of its own chunk) and the pool took its process over
        (``record`` then gets its result later)."""
        timeout_s = self.pool.timeout_s
        if timeout_s is None:
            return child.receive(None)
        started = time.monotonic()
        deadline, patience = started + timeout_s, self.pool.hand_off_after()
        reply = child.receive(started + patience)
        while reply is TIMED_OUT and time.monotonic() < deadline:
            if (more or self.pool.work_waiting()) and self.pool.hand_off(child, deadline, record):
                self.child = None
                return _HANDED_OFF
            reply = child.receive(min(deadline, time.monotonic() + min(patience, _POLL_S)))
        if reply is not TIMED_OUT and reply is not DIED:
            self.pool.note_sample_time(time.monotonic() - started)
        return reply

    def _lose_child(self, chunk: _Chunk, position: int, how) -> None:
        """Drop the sample the process was running, replace the process, requeue the rest."""
        child = self.child
        if how is TIMED_OUT:
            results = [reply_result(reply) for reply in child.kill()]  # answers written before the kill count
            if not results:  # else the running sample had not had its full time: it goes again
                results.append(timeout_failure(self.pool.timeout_s))
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
                self.child = RewardChild(self.pool.fn_spec)

    def interrupt(self) -> None:
        """From another thread: kill the process; this slot's thread sees it die and cleans up."""
        child = self.child
        if child is not None:
            child.signal_kill()
