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
as ``reward_raised``, with or without a timeout.

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
import itertools
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rldsl.rewards import RewardLoadError
from rldsl.runtime.control.ledger import REWARD_INVALID, REWARD_RAISED, REWARD_TIMEOUT
from rldsl.runtime.protocols import RewardFailure
from rldsl.runtime.reward_process import FrameBuffer, write_frame

DEFAULT_PROCESSES = 2  # per worker: a hung sample blocks one, the other keeps scoring
STARTUP_TIMEOUT_S = 120.0  # importing a reward's module may be slow; it is not the reward's timeout

Sample = tuple[str, str, str]  # (response, answer, prompt)

_TIMED_OUT, _DIED = object(), object()


class RewardPool:
    """``score(samples)`` -> one float or ``RewardFailure`` per sample.

    Processes start at construction (in the background: the constructor
    returns at once); ``wait_ready`` waits for them and raises
    ``RewardLoadError`` when the function does not import.
    """

    def __init__(self, fn_spec: str, processes: int = DEFAULT_PROCESSES, timeout_s: float | None = None):
        self.fn_spec = fn_spec
        self.timeout_s = timeout_s or None  # 0 or None: no deadline, crashes are still isolated
        self._queue = _ChunkQueue()
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
                raise RewardLoadError(f"reward {self.fn_spec!r}: its process did not start within {timeout_s:g}s")
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
        for slot in self._slots:
            slot.thread.join(timeout=5.0)

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
        self.child: _Child | None = None
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

    def _live_child(self) -> _Child:
        """The slot's process, started if need be, once it has imported the function."""
        if self.child is None:
            try:
                self.child = _Child(self.pool.fn_spec)
            except OSError as error:
                raise RewardLoadError(f"reward {self.pool.fn_spec!r}: cannot start a reward process: {error}") from None
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
        timeout_s = self.pool.timeout_s
        for position, index in enumerate(chunk.indices):
            reply = child.receive(None if timeout_s is None else time.monotonic() + timeout_s)
            if reply is _TIMED_OUT or reply is _DIED:
                self._lose_child(chunk, position, reply)
                return
            chunk.call.record(index, _result(reply))

    def _lose_child(self, chunk: _Chunk, position: int, how) -> None:
        """Drop the sample the process was running, replace the process, requeue the rest."""
        child = self.child
        if how is _TIMED_OUT:
            results = [_result(reply) for reply in child.kill()]  # answers written before the kill count
            if not results:  # else the running sample had not had its full time: it goes again
                results.append(RewardFailure(REWARD_TIMEOUT, f"no result within the {self.pool.timeout_s:g}s "
                                                             "timeout; its process was killed"))
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
                self.child = _Child(self.pool.fn_spec)

    def interrupt(self) -> None:
        """From another thread: kill the process; this slot's thread sees it die and cleans up."""
        child = self.child
        if child is not None:
            child.signal_kill()


class _Child:
    """One reward process and the two pipes to it."""

    def __init__(self, fn_spec: str):
        to_child_read, self._to_child = os.pipe()
        self._from_child, from_child_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rldsl.runtime.reward_process", str(to_child_read), str(from_child_write),
                 str(os.getpid())],
                pass_fds=(to_child_read, from_child_write), stdin=subprocess.DEVNULL, env=_child_env())
        except OSError:
            for fd in (self._to_child, self._from_child):
                os.close(fd)
            raise
        finally:
            os.close(to_child_read)
            os.close(from_child_write)
        self.fn_spec = fn_spec
        self._frames = FrameBuffer()
        self._poll = select.poll()  # poll, not select: a Ray worker's descriptors may exceed FD_SETSIZE
        self._poll.register(self._from_child, select.POLLIN)
        self._ready = False
        self._closed = False
        self.send((sys.path, fn_spec))

    def wait_ready(self) -> None:
        if self._ready:
            return
        reply = self.receive(time.monotonic() + STARTUP_TIMEOUT_S)
        if reply is _TIMED_OUT or reply is _DIED:
            what = "did not start in time" if reply is _TIMED_OUT else f"exited while starting ({self.reap()})"
            raise RewardLoadError(f"reward {self.fn_spec!r}: its process {what}")
        if reply[0] == "load_error":
            raise RewardLoadError(reply[1])
        self._ready = True

    def send(self, message) -> bool:
        try:
            write_frame(self._to_child, message)
            return True
        except OSError:  # it died: the caller finds out on receive
            return False

    def receive(self, deadline: float | None):
        """The next answer, ``_TIMED_OUT`` past ``deadline`` or ``_DIED`` at end of pipe."""
        while (message := self._frames.pop()) is None:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
            if not self._poll.poll(wait_ms):
                return _TIMED_OUT
            data = os.read(self._from_child, 1 << 16)
            if not data:
                return _DIED
            self._frames.feed(data)
        return message

    def signal_kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    def kill(self) -> list:
        """Kill and reap it; the answers it wrote before it died."""
        if self._closed:
            return []
        self.signal_kill()
        self.process.wait()
        answers = []
        while self._poll.poll(0):
            data = os.read(self._from_child, 1 << 16)
            if not data:
                break
            self._frames.feed(data)
        while (message := self._frames.pop()) is not None:
            answers.append(message)
        self._close_pipes()
        return answers

    def reap(self) -> str:
        """How it ended, once it has (it is killed if it lingers)."""
        try:
            code = self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self._close_pipes()
        if code >= 0:
            return f"exit code {code}"
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"

    def _close_pipes(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._to_child)
            os.close(self._from_child)


def _result(reply) -> float | RewardFailure:
    kind, payload = reply
    if kind == "ok":
        return payload
    return RewardFailure(REWARD_INVALID if kind == "invalid" else REWARD_RAISED, payload)


def _child_env() -> dict:
    """The worker's environment, plus where this package lives (the child
    must import it before it can take the worker's ``sys.path``)."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env
