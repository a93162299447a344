"""One reward process: imports the reward function once, then scores chunks.

``RewardPool`` (reward_pool.py) starts it as ``python -m
rldsl.runtime.reward_process READ_FD WRITE_FD PARENT_PID``. It talks over two
pipes in length-prefixed pickles: the first message in is ``(sys_path,
"module:function")``, answered ``("ready",)`` or ``("load_error", text)``;
after that each message in is a chunk, a list of ``(response, answer,
prompt)``, and every sample is answered on its own the moment it is scored,
so the pool always knows which sample is running and can time each one.

Answers: ``("ok", float)`` (``("ok", total, {name: value})`` for a stage's
named components), ``("raised", "ValueError: ...")`` or
``("invalid", "reward returned str, not a number")``. Only floats and
strings cross the pipe, so a result that does not pickle cannot break it.

This module imports nothing heavy: a process is cheap to start and replace.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import threading
import time

from rldsl.rewards import RewardComponentError, RewardLoadError, WeightedRewards, checked_reward, load_reward

_HEADER = struct.Struct("!I")  # the length of the pickle that follows
_READ_SIZE = 1 << 16


def write_frame(fd: int, message) -> None:
    data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd: int):
    """The next message, blocking; None when the other end has closed."""
    header = _read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    body = _read_exactly(fd, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def _read_exactly(fd: int, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        part = os.read(fd, min(size - len(data), _READ_SIZE))
        if not part:
            return None
        data += part
    return bytes(data)


class FrameBuffer:
    """Whole messages out of bytes that arrive in pieces of any size."""

    def __init__(self):
        self._data = bytearray()

    def feed(self, data: bytes) -> None:
        self._data += data

    def pop(self):
        """The oldest whole message, or None while it is incomplete."""
        if len(self._data) < _HEADER.size:
            return None
        end = _HEADER.size + _HEADER.unpack_from(self._data)[0]
        if len(self._data) < end:
            return None
        message = pickle.loads(self._data[_HEADER.size:end])
        del self._data[:end]
        return message


def score_sample(fn, response: str, answer: str, prompt: str) -> tuple:
    """``("ok", float)``, for named components ``("ok", total, {name: value})``;
    ``("raised", text)`` or ``("invalid", text)``."""
    try:
        if isinstance(fn, WeightedRewards):
            parts = fn.parts(response, answer, prompt)
            return "ok", fn.total(parts), parts
        value = fn(response, answer, prompt)
    except RewardComponentError as error:
        return "raised", str(error)
    except BaseException as error:  # noqa: BLE001 - sys.exit() in a reward drops only its sample too
        return "raised", f"{type(error).__name__}: {error}"
    number, problem = checked_reward(value)
    return ("invalid", problem) if problem else ("ok", number)


def describe_spec(spec) -> str:
    """A reward spec for messages: ``'m:f'``, or the components' names and functions."""
    if isinstance(spec, str):
        return repr(spec)
    return "[" + ", ".join(f"{part['name']}({part['fn']!r})" for part in spec) + "]"


def main(argv: list[str]) -> None:
    def answer(fn, chunk):
        for response, answer_text, prompt in chunk:
            yield score_sample(fn, response, answer_text, prompt)

    serve(argv, load_reward, answer, lambda spec, error: str(error) if isinstance(error, RewardLoadError)
          else f"reward {describe_spec(spec)}: {type(error).__name__}: {error}")


def serve(argv: list[str], load, answer, describe_load_error) -> None:
    """The child side of a killable process (rewards, environments): read
    ``(sys_path, spec)``, ``load(spec)`` once (``("load_error", text)`` if it
    fails, else ``("ready",)``), then write the frames ``answer(loaded,
    message)`` yields for each message, until the pipe closes."""
    read_fd, write_fd, parent_pid = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the worker to handle, not its children
    exit_when_orphaned(parent_pid)
    parent_path, spec = read_frame(read_fd)
    take_parent_path(parent_path)
    try:
        loaded = load(spec)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it in the worker
        write_frame(write_fd, ("load_error", describe_load_error(spec, error)))
        return
    write_frame(write_fd, ("ready",))
    while (message := read_frame(read_fd)) is not None:
        for frame in answer(loaded, message):
            write_frame(write_fd, frame)


def take_parent_path(parent_path: list[str]) -> None:
    """The worker's import path entries this process lacks, after its own:
    the same interpreter's packages come first, so an entry the worker
    gained at run time (such as setuptools' vendored copies) shadows none of
    them; a module beside a pipeline file is found by its own anchor."""
    sys.path += [entry for entry in parent_path if entry not in sys.path]


def exit_when_orphaned(parent_pid: int) -> None:
    """A worker killed outright cannot kill its reward processes: a process
    hung in a reward would live on, so it watches for its parent to go."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (BrokenPipeError, KeyboardInterrupt):
        pass  # the pool went away
