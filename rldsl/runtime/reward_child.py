"""One reward process seen from the pool (reward_pool.py): starting it,
the two pipes to it, killing and reaping it, and the hand-off of a process
whose sample runs long.

A hand-off frees the pool's slot while a sample may be hanging: the slot
gives the process, with the one sample it is running, to a watcher thread
and carries on with a new process; the watcher records that sample's
answer if it comes before the deadline, else kills the process at the
deadline and drops the sample as ``reward_timeout``. Either way the process
goes: it was sent the rest of its chunk, which the slot scores again.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from rldsl.rewards import RewardLoadError
from rldsl.runtime.control.ledger import REWARD_INVALID, REWARD_RAISED, REWARD_STRAGGLER, REWARD_TIMEOUT
from rldsl.runtime.protocols import ComponentReward, RewardFailure
from rldsl.runtime.reward_process import FrameBuffer, describe_spec, write_frame

STARTUP_TIMEOUT_S = 120.0  # importing a reward's module may be slow; it is not the reward's timeout

TIMED_OUT, DIED = object(), object()


class RewardChild:
    """One reward process and the two pipes to it."""

    def __init__(self, fn_spec: str | list):
        to_child_read, self._to_child = os.pipe()
        self._from_child, from_child_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rldsl.runtime.reward_process", str(to_child_read), str(from_child_write),
                 str(os.getpid())],
                pass_fds=(to_child_read, from_child_write), stdin=subprocess.DEVNULL, env=child_env())
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
        if reply is TIMED_OUT or reply is DIED:
            what = "did not start in time" if reply is TIMED_OUT else f"exited while starting ({self.reap()})"
            raise RewardLoadError(f"reward {describe_spec(self.fn_spec)}: its process {what}")
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
        """The next answer, ``TIMED_OUT`` past ``deadline`` or ``DIED`` at end of pipe."""
        while (message := self._frames.pop()) is None:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
            if not self._poll.poll(wait_ms):
                return TIMED_OUT
            data = os.read(self._from_child, 1 << 16)
            if not data:
                return DIED
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


def reply_result(reply) -> float | RewardFailure:
    kind, payload, *parts = reply
    if kind == "ok":
        return ComponentReward(payload, parts[0]) if parts else payload
    return RewardFailure(REWARD_INVALID if kind == "invalid" else REWARD_RAISED, payload)


def child_env() -> dict:
    """The worker's environment, plus where this package lives (the child
    must import it before it can take the worker's ``sys.path``)."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def timeout_failure(timeout_s: float) -> RewardFailure:
    return RewardFailure(REWARD_TIMEOUT, f"no result within the {timeout_s:g}s timeout; its process was killed")


def straggler_failure(limit_s: float, factor: float) -> RewardFailure:
    return RewardFailure(REWARD_STRAGGLER, f"no result after {limit_s:.2g}s, {factor:g} times the reward's usual "
                                           "time per sample; its process was killed")


def lowest_priority(pid: int) -> None:
    """A handed-off process (it will serve nothing more) runs at nice 19: a
    hang that spins gets only the CPU that the run's own work leaves, not a
    core of a small machine until its deadline."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    except OSError:  # gone already, or a platform without it: it is killed at its deadline anyway
        pass


def watch_handed_off(child: RewardChild, deadline: float, overran: RewardFailure, record: Callable[[object], None],
                     done: Callable[[RewardChild], None]) -> threading.Thread:
    """A thread that waits for the one sample ``child`` is running until
    ``deadline``, records its result (``overran`` past the deadline), kills
    the process and calls ``done``; meanwhile the process runs at the lowest
    priority."""
    lowest_priority(child.process.pid)

    def watch() -> None:
        try:
            reply = child.receive(deadline)
            if reply is TIMED_OUT:
                answers = child.kill()  # an answer written just before the kill still counts
                record(reply_result(answers[0]) if answers else overran)
            elif reply is DIED:
                record(RewardFailure(REWARD_RAISED, f"the reward process died ({child.reap()}) scoring this sample"))
            else:
                child.kill()
                record(reply_result(reply))
        finally:
            done(child)

    thread = threading.Thread(target=watch, daemon=True, name="reward-process-handed-off")
    thread.start()
    return thread
