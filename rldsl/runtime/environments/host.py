"""``EnvironmentHost``: a generator worker's environments, one process per episode.

Up to ``processes`` forking servers (process.py) import the environment's
class once each; every episode then runs in a process forked from one of
them (half a millisecond) that keeps the environment's instance for the
whole episode: state that does not pickle (an open subprocess, a socket, a
sandbox, an event loop) lives across turns.

A turn's calls go to their episodes' processes at once and are read back as
they answer (``exchange``), so a slow call holds only its own episode. A
call that overruns ``timeout_s`` has its process killed and a process that
dies is noticed when its socket closes: either way only that episode fails
(``EpisodeStatus``). With a ``straggler`` factor, a reset or step call is
taken for hung, and killed the same way, once it has run that many times
the usual call time (a moving average, at least ``STRAGGLER_FLOOR_S``): a
hang then costs its turn about that long, not the whole timeout. A server
that dies is started again on the next episode.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from rldsl.runtime.environments.protocol import EnvironmentLoadError, EpisodeStatus
from rldsl.runtime.reward_child import child_env
from rldsl.runtime.reward_process import FrameBuffer, write_frame

STARTUP_TIMEOUT_S = 120.0  # importing the environment's module may be slow; it is not a call's timeout
FORK_TIMEOUT_S = 30.0  # a server answers a fork in milliseconds; one that does not is replaced
FORKS_PER_MESSAGE = 128  # episodes a server forks per request (SCM_RIGHTS carries at most 253 descriptors)
CLOSE_TIMEOUT_S = 5.0  # an environment's close() at the end of its episode, at most (then it is killed)
STRAGGLER_FLOOR_S = 0.2  # never taken for hung sooner: a loaded machine delays a quick call this much
STRAGGLER_AFTER_CALLS = 16  # calls answered before their usual time is trusted


@dataclass(frozen=True)
class CallFailure:
    """A call that gave no answer: how (its status) and what happened."""

    status: EpisodeStatus
    detail: str


class EpisodeProcess:
    """One episode's process: the host's end of its socket, and how to kill it."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self.frames = FrameBuffer()
        try:  # a pidfd, so a kill never reaches another process that reused the pid
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None
        self.ended = False

    def send(self, message) -> bool:
        try:
            write_frame(self.sock.fileno(), message)
            return True
        except OSError:
            return False

    def kill(self) -> None:
        """Kill it (if still running) and let go of its socket."""
        if self.ended:
            return
        self.ended = True
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except OSError:  # gone already
            pass
        for closing in (self.sock.close, lambda: self._pidfd is not None and os.close(self._pidfd)):
            try:
                closing()
            except OSError:
                pass


class _Server:
    """One forking server (a child process) and the socket to it."""

    def __init__(self, spec: str, tool_specs: tuple[str, ...] = ()):
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rldsl.runtime.environments.process", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=child_env())
        finally:
            theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        write_frame(ours.fileno(), (sys.path, spec, list(tool_specs)))
        reply = self._receive(STARTUP_TIMEOUT_S)
        if not isinstance(reply, tuple) or reply[0] != "ready":
            self.kill()
            text = reply[1] if isinstance(reply, tuple) else f"environment {spec!r}: its process {reply}"
            raise EnvironmentLoadError(text)
        self.has_close = reply[1]  # without a close() an episode's end is its process's kill
        self.tool_schemas = reply[2]
        self.kind = reply[3]  # "class": reset and step; "harness": a function that runs the episode

    def fork(self, count: int) -> list[EpisodeProcess] | None:
        """``count`` new episodes' processes, or None when this server no longer answers."""
        with self.lock:
            try:
                write_frame(self.sock.fileno(), ("episodes", count))
                self.sock.settimeout(FORK_TIMEOUT_S)
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, count)
            except OSError:
                return None
            finally:
                self.sock.settimeout(None)
        pids = pickle.loads(data) if data else []
        if len(fds) != count or len(pids) != count:
            for fd in fds:
                os.close(fd)
            return None
        return [EpisodeProcess(socket.socket(fileno=fd), pid) for fd, pid in zip(fds, pids)]

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.sock.close()

    def _receive(self, timeout_s: float):
        buffer, deadline = FrameBuffer(), time.monotonic() + timeout_s
        poll = select.poll()  # poll, not select: a Ray worker's descriptors may exceed FD_SETSIZE
        poll.register(self.sock.fileno(), select.POLLIN)
        while (message := buffer.pop()) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poll.poll(int(remaining * 1000) + 1):
                return "timed out"
            data = self.sock.recv(1 << 16)
            if not data:
                return f"ended ({self.process.wait()})"
            buffer.feed(data)
        return message


class EnvironmentHost:
    def __init__(self, spec: str, timeout_s: float | None, processes: int, tools: tuple[str, ...] = (),
                 straggler: float = 0.0):
        self.spec, self.timeout_s, self.tool_specs = spec, timeout_s, tuple(tools)
        self.straggler = straggler
        self._usual_s: float | None = None  # a reset or step call's usual time (moving average)
        self._calls_timed = 0
        self._timing_lock = threading.Lock()  # not the servers' lock: that one is held while a server starts
        self._servers: list[_Server | None] = [_Server(spec, self.tool_specs)]  # at once: one that does not load fails
        self.tool_schemas: list[dict] = self._servers[0].tool_schemas  # the tools' and the class's, as templates take them
        self.kind = self._servers[0].kind
        self._servers += [None] * (max(1, processes) - 1)  # the others start with the first episodes they serve
        self._next = 0
        self._has_close = self._servers[0].has_close
        self._lock = threading.Lock()
        self.episodes_started = 0  # (for tests and diagnostics)

    def open(self, count: int) -> list[EpisodeProcess | CallFailure]:
        """A process for each of ``count`` new episodes."""
        opened: list = []
        while len(opened) < count:
            opened += self._fork(min(FORKS_PER_MESSAGE, count - len(opened)))
        return opened

    def _fork(self, count: int) -> list:
        with self._lock:
            index = self._next
            self._next = (self._next + 1) % len(self._servers)
        for _ in range(2):  # a server that died is started again once
            server = self._server(index)
            processes = server.fork(count)
            if processes is not None:
                with self._lock:
                    self.episodes_started += count
                return processes
            server.kill()
        return [CallFailure(EpisodeStatus.DIED, "the environment's forking server stopped answering")] * count

    def _server(self, index: int) -> _Server:
        with self._lock:
            server = self._servers[index]
            if server is not None and server.alive:
                return server
            self._servers[index] = server = _Server(self.spec, self.tool_specs)
            return server

    def exchange(self, calls: list[tuple[EpisodeProcess, tuple]], timeout_s: float | None = None,
                 excused=None, stragglers: bool = True) -> list:
        """Each call sent to its episode's process at once, each answer (the
        reply tuple, or a ``CallFailure``) read as it comes; in order.
        ``excused(index)``: seconds of that call's time its timeout does not
        count (an agent harness's waits on the model). ``stragglers``: these
        are reset or step calls, timed into the usual call time and cut at
        ``straggler`` times it."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        cut_s = self._straggler_limit() if stragglers else None
        limit_s = min(s for s in (timeout_s, cut_s, float("inf")) if s)
        started = time.monotonic()

        def deadline(index: int) -> float:
            return started + limit_s + (excused(index) if excused else 0.0)

        def overran() -> CallFailure:
            if cut_s is not None and limit_s == cut_s:
                return CallFailure(EpisodeStatus.STRAGGLER, f"no answer after {cut_s:.2g}s, {self.straggler:g} "
                                                            "times the environment's usual call time; its process "
                                                            "was killed")
            return CallFailure(EpisodeStatus.TIMEOUT, f"no answer within the {timeout_s:g}s timeout; its process "
                                                      "was killed")

        answers: list = [None] * len(calls)
        waiting: dict[int, int] = {}  # fd -> index
        poll = select.poll()
        for index, (process, message) in enumerate(calls):
            if process.ended or not process.send(message):
                answers[index] = self._died(process)
            else:
                waiting[process.sock.fileno()] = index
                poll.register(process.sock.fileno(), select.POLLIN)
        while waiting:
            soonest = min(deadline(index) for index in waiting.values()) if limit_s != float("inf") else None
            wait_ms = None if soonest is None else max(0, int((soonest - time.monotonic()) * 1000) + 1)
            events = poll.poll(wait_ms)
            if not events:  # a deadline passed: what has not answered by its own is killed
                for fd, index in list(waiting.items()):
                    if time.monotonic() >= deadline(index):
                        calls[index][0].kill()
                        answers[index] = overran()
                        poll.unregister(fd)
                        del waiting[fd]
                continue
            for fd, _ in events:
                index = waiting[fd]
                answer = self._read(calls[index][0])
                if answer is not None:
                    answers[index] = answer
                    poll.unregister(fd)
                    del waiting[fd]
                    if stragglers and not isinstance(answer, CallFailure):
                        self._time_call(time.monotonic() - started)
        return answers

    def _straggler_limit(self) -> float | None:
        """How long a reset or step call may run before it is taken for hung (None: until its timeout)."""
        with self._timing_lock:
            if not self.straggler or self._calls_timed < STRAGGLER_AFTER_CALLS:
                return None
            return max(STRAGGLER_FLOOR_S, self.straggler * self._usual_s)

    def _time_call(self, seconds: float) -> None:
        with self._timing_lock:
            self._usual_s = seconds if self._usual_s is None else 0.9 * self._usual_s + 0.1 * seconds
            self._calls_timed += 1

    def _read(self, process: EpisodeProcess):
        """The process's answer once whole, a ``CallFailure`` if it ended, else None."""
        if (message := process.frames.pop()) is not None:
            return message
        try:
            data = process.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            return self._died(process)
        process.frames.feed(data)
        return process.frames.pop()

    @staticmethod
    def _died(process: EpisodeProcess) -> CallFailure:
        process.kill()
        return CallFailure(EpisodeStatus.DIED, "the episode's environment process ended without answering")

    def finish(self, processes: list[EpisodeProcess]) -> None:
        """End the episodes: each environment's ``close()`` (at most
        ``CLOSE_TIMEOUT_S``), then its process."""
        running = [process for process in processes if not process.ended]
        if self._has_close:
            self.exchange([(process, ("close",)) for process in running], CLOSE_TIMEOUT_S, stragglers=False)
        for process in running:
            process.kill()

    def close(self) -> None:
        """Stop the servers (the episodes' processes die with them)."""
        with self._lock:
            servers, self._servers = self._servers, [None] * len(self._servers)
        for server in servers:
            if server is not None:
                server.kill()
