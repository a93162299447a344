"""``EnvironmentHost``: a generator worker's environment processes.

Every ``reset`` or ``step`` runs in one of up to ``processes`` child
processes (process.py), with the environment's state pickled in and out, so
any process can run any call. A call that overruns ``timeout_s`` has its
process killed, a process that dies is reaped; either way only that call's
episode fails (``EpisodeStatus``) and a fresh process takes the slot.

A call that runs long (a tenth of the timeout, at least ``HAND_OFF_MIN_S``)
hands its slot off: it waits out its deadline in its own process while the
slot takes the next call in a fresh one, as the reward pool does, so a hung
call costs its own episode and never the other episodes' calls. At most
``HANDED_OFF_PER_PROCESS`` calls per slot wait out a deadline at once.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rldsl.runtime.environments.protocol import EnvironmentLoadError, EpisodeStatus
from rldsl.runtime.reward_child import child_env, lowest_priority
from rldsl.runtime.reward_process import FrameBuffer, write_frame

STARTUP_TIMEOUT_S = 120.0  # importing the environment's module may be slow; it is not a call's timeout
HAND_OFF_SHARE = 0.1  # of the timeout a call runs in its slot before the slot is handed off
HAND_OFF_MIN_S = 0.5  # ... and never sooner: most calls take milliseconds, a fresh process ~0.2 s
HANDED_OFF_PER_PROCESS = 4  # calls waiting out their deadline outside the slots, per slot at most


@dataclass(frozen=True)
class CallFailure:
    """A call that gave no answer: how (its status) and what happened."""

    status: EpisodeStatus
    detail: str


class _Child:
    """One environment process and the two pipes to it."""

    def __init__(self, spec: str):
        to_child_read, self._to_child = os.pipe()
        self._from_child, from_child_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rldsl.runtime.environments.process", str(to_child_read),
                 str(from_child_write), str(os.getpid())],
                pass_fds=(to_child_read, from_child_write), stdin=subprocess.DEVNULL, env=child_env())
        finally:
            os.close(to_child_read)
            os.close(from_child_write)
        self._frames = FrameBuffer()
        self._poll = select.poll()  # poll, not select: a Ray worker's descriptors may exceed FD_SETSIZE
        self._poll.register(self._from_child, select.POLLIN)
        write_frame(self._to_child, (sys.path, spec))
        reply = self.receive(time.monotonic() + STARTUP_TIMEOUT_S)
        if not isinstance(reply, tuple) or reply[0] != "ready":
            self.kill()
            text = reply[1] if isinstance(reply, tuple) else f"environment {spec!r}: its process {reply}"
            raise EnvironmentLoadError(text)

    def call(self, message, timeout_s: float | None, hand_off: tuple[float, object] | None = None):
        """The answer, or a ``CallFailure``. ``hand_off``: ``(after_s, release)``,
        ``release()`` called once the call has run ``after_s`` unanswered."""
        try:
            write_frame(self._to_child, message)
        except OSError:
            return CallFailure(EpisodeStatus.DIED, f"the environment process died ({self.kill()})")
        deadline = None if not timeout_s else time.monotonic() + timeout_s
        reply = "timed out"
        if hand_off is not None and deadline is not None:
            after_s, release = hand_off
            reply = self.receive(min(deadline, time.monotonic() + after_s))
            if reply == "timed out" and time.monotonic() < deadline and release():
                lowest_priority(self.process.pid)  # handed off: it serves nothing more once it answers
        if reply == "timed out":
            reply = self.receive(deadline)
        if reply == "timed out":
            self.kill()
            return CallFailure(EpisodeStatus.TIMEOUT, f"no answer within the {timeout_s:g}s timeout; "
                                                      "its process was killed")
        if reply == "died":
            return CallFailure(EpisodeStatus.DIED, f"the environment process died ({self.kill()})")
        return reply

    def receive(self, deadline: float | None):
        while (message := self._frames.pop()) is None:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
            if not self._poll.poll(wait_ms):
                return "timed out"
            data = os.read(self._from_child, 1 << 16)
            if not data:
                return "died"
            self._frames.feed(data)
        return message

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> str:
        """Kill and reap it; how it ended."""
        if self.process.poll() is None:
            self.process.kill()
        code = self.process.wait()
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"


class EnvironmentHost:
    def __init__(self, spec: str, timeout_s: float | None, processes: int):
        self.spec, self.timeout_s = spec, timeout_s
        self._processes = processes = max(1, processes)
        self._slots = threading.Semaphore(processes)
        self._lock = threading.Lock()
        self._idle: list[_Child] = [_Child(spec)]  # the first at once: an environment that does not load fails here
        self._handed_off, self._max_handed_off = 0, HANDED_OFF_PER_PROCESS * processes
        self.handed_off_total = 0  # calls that gave their slot up (for tests and diagnostics)
        self._pool = ThreadPoolExecutor(processes + self._max_handed_off, thread_name_prefix="environment-call")

    def call(self, message):
        """The child's answer tuple, or a ``CallFailure``."""
        self._slots.acquire()
        holding = [True]

        def release() -> bool:  # this call runs long: its slot takes the next call in a fresh process
            with self._lock:
                if self._handed_off >= self._max_handed_off:
                    return False
                self._handed_off += 1
                self.handed_off_total += 1
            holding[0] = False
            self._slots.release()
            return True

        try:
            with self._lock:
                child = self._idle.pop() if self._idle else None
            child = child if child is not None and child.alive else _Child(self.spec)
            hand_off = (max(HAND_OFF_MIN_S, HAND_OFF_SHARE * self.timeout_s), release) if self.timeout_s else None
            reply = child.call(message, self.timeout_s, hand_off)
            if not isinstance(reply, CallFailure):
                with self._lock:
                    keep = holding[0] and len(self._idle) < self._processes  # a handed-off one runs niced: not kept
                    if keep:
                        self._idle.append(child)
                if not keep:
                    child.kill()
            return reply
        finally:
            if holding[0]:
                self._slots.release()
            else:
                with self._lock:
                    self._handed_off -= 1

    def map(self, messages: list) -> list:
        """Every call, in parallel over the processes; answers in order."""
        return list(self._pool.map(self.call, messages))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()
