"""``EnvironmentHost``: a generator worker's environment processes.

Every ``reset`` or ``step`` runs in one of up to ``processes`` child
processes (process.py), with the environment's state pickled in and out, so
any process can run any call. A call that overruns ``timeout_s`` has its
process killed, a process that dies is reaped; either way only that call's
episode fails (``EpisodeStatus``) and a fresh process takes the slot.
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
from rldsl.runtime.reward_child import child_env
from rldsl.runtime.reward_process import FrameBuffer, write_frame

STARTUP_TIMEOUT_S = 120.0  # importing the environment's module may be slow; it is not a call's timeout


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

    def call(self, message, timeout_s: float | None):
        try:
            write_frame(self._to_child, message)
        except OSError:
            return CallFailure(EpisodeStatus.DIED, f"the environment process died ({self.kill()})")
        reply = self.receive(None if not timeout_s else time.monotonic() + timeout_s)
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
        self._slots = threading.Semaphore(max(1, processes))
        self._lock = threading.Lock()
        self._idle: list[_Child] = [_Child(spec)]  # the first at once: an environment that does not load fails here
        self._pool = ThreadPoolExecutor(max(1, processes), thread_name_prefix="environment-call")

    def call(self, message):
        """The child's answer tuple, or a ``CallFailure``."""
        with self._slots:
            with self._lock:
                child = self._idle.pop() if self._idle else None
            child = child if child is not None and child.alive else _Child(self.spec)
            reply = child.call(message, self.timeout_s)
            if not isinstance(reply, CallFailure):
                with self._lock:
                    self._idle.append(child)
            return reply

    def map(self, messages: list) -> list:
        """Every call, in parallel over the processes; answers in order."""
        return list(self._pool.map(self.call, messages))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()
