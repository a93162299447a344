"""The environment's processes: a forking server, and one process per episode.

``EnvironmentHost`` (host.py) starts the server as ``python -m
rldsl.runtime.environments.process SOCKET_FD PARENT_PID``. Over that Unix
socket, in the reward processes' length-prefixed pickles
(``rldsl.runtime.reward_process``), the first message in is ``(sys_path,
"module:Class", tool_specs)``, answered ``("ready", has_close,
tool_schemas)`` or ``("load_error", text)``: the class and its tools are
imported once, here. After that each message in is
``("episodes", count)``: the server forks a process for each of ``count``
episodes and passes the host its ends of the new socket pairs
(``SCM_RIGHTS``) with the processes' pids.

The episode's process builds the environment and keeps it for the whole
episode, so whatever it holds (an open subprocess, a socket, a sandbox, an
event loop) lives across turns. Its calls:

- ``("reset", prompt, answer)`` -> ``("ok", messages)``
- ``("step", messages, completion)`` -> ``("ok", (observation, reward, done))``
- ``("tools", [(name, arguments), ...])`` -> ``("ok", [text, ...])``: the
  calls run at once (threads; coroutine functions on the loop), each
  answered with its result or an ``error: ...`` the model reads;
- ``("close",)`` -> ``("ok",)``, after the environment's ``close()`` if it
  has one; then the process exits;
- for an agent harness instead: ``("harness", prompt, answer, url, token,
  episode)`` -> ``("ok", reward)``: the harness runs the whole episode with
  an OpenAI client on ``url`` that names ``episode`` in every request.

A method may be a coroutine function: it runs on the process's one event
loop. A call that raises or returns something malformed is answered
``("raised", text)``; the host kills a process whose call overruns its
timeout. A forked process dies with its server (``PR_SET_PDEATHSIG``), the
server when its host goes.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import signal
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

from rldsl.rewards import checked_reward
from rldsl.runtime.environments.protocol import (
    EPISODE_HEADER,
    EnvironmentLoadError,
    checked_messages,
    checked_step,
    is_harness,
    load_environment,
    load_tools,
)
from rldsl.runtime.environments.tool_calls import result_text, tool_schema
from rldsl.runtime.reward_process import exit_when_orphaned, read_frame, take_parent_path, write_frame

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def serve_forks(channel: socket.socket, cls, tools: dict) -> None:
    """The server's loop: ``count`` forked episode processes per ``("episodes", count)``."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the episodes' processes
    prctl = _prctl()  # looked up once: a fork costs half a millisecond, an import more
    while (message := read_frame(channel.fileno())) is not None:
        pids, ends = [], []
        for _ in range(message[1]):
            ours, theirs = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                channel.close()
                for end in [ours, *ends]:
                    end.close()
                _run_episode(theirs, cls, tools, prctl)
            theirs.close()
            pids.append(pid)
            ends.append(ours)
        socket.send_fds(channel, [pickle.dumps(pids)], [end.fileno() for end in ends])
        for end in ends:
            end.close()


def _run_episode(sock: socket.socket, cls, tools: dict, prctl) -> None:
    """The episode's process: never returns."""
    code = 0
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the environment may wait for processes of its own
        _die_with_parent(prctl)
        episode = _Episode(cls, tools)
        while (call := read_frame(sock.fileno())) is not None:
            write_frame(sock.fileno(), episode.answer(call))
            if call[0] == "close":
                break
    except BaseException:  # noqa: BLE001 - the host sees the socket close: the episode died
        code = 1
    finally:
        os._exit(code)


class _Episode:
    def __init__(self, cls, tools: dict):
        self.cls, self.tools, self.env, self.loop = cls, tools, None, None

    def answer(self, call: tuple) -> tuple:
        try:
            if call[0] == "harness":
                return "ok", self._run_harness(*call[1:])
            if call[0] == "reset":
                self.env = self.cls()
                return "ok", checked_messages(self._resolve(self.env.reset(call[1], call[2])))
            if call[0] == "step":
                return "ok", checked_step(self._resolve(self.env.step([dict(m) for m in call[1]], call[2])))
            if call[0] == "tools":
                return "ok", self._call_tools(call[1])
            close = getattr(self.env, "close", None)
            if callable(close):
                self._resolve(close())
            return ("ok",)
        except BaseException as error:  # noqa: BLE001 - sys.exit() in an environment drops only its sample too
            return "raised", f"{call[0]}: {type(error).__name__}: {error}"

    def _run_harness(self, prompt: str, answer: str, url: str, token: str, episode: str) -> float:
        import httpx
        import openai

        asynchronous = inspect.iscoroutinefunction(self.cls)
        client_class, http = (openai.AsyncOpenAI, httpx.AsyncClient) if asynchronous else (openai.OpenAI, httpx.Client)
        client = client_class(base_url=url, api_key=token, default_headers={EPISODE_HEADER: episode}, max_retries=0,
                              http_client=http(trust_env=False, timeout=None))  # loopback: never a proxy
        reward, problem = checked_reward(self._resolve(self.cls(client, prompt, answer)))
        if problem:
            raise TypeError(f"an agent harness returns the episode's reward, a finite number; its {problem}")
        return reward

    def _call_tools(self, calls: list) -> list[str]:
        """Every call at once; a tool that is unknown, refuses its arguments or raises answers ``error: ...``."""
        with ThreadPoolExecutor(max(1, len(calls))) as pool:
            running = [pool.submit(self._call_tool, name, arguments) for name, arguments in calls]
            results = [future.result() for future in running]
        pending = [index for index, value in enumerate(results) if inspect.isawaitable(value)]
        if pending:  # coroutine functions' calls: together on the episode's loop
            settled = self._resolve(_settle_all([results[index] for index in pending]))
            for index, value in zip(pending, settled):
                results[index] = value
        return results

    def _call_tool(self, name: str, arguments: dict):
        fn = self.tools.get(name)
        if fn is None:
            return f"error: there is no tool `{name}`; the tools are {', '.join(sorted(self.tools)) or 'none'}"
        try:
            value = fn(**arguments)
        except BaseException as error:  # noqa: BLE001 - the model reads what went wrong
            return f"error: {type(error).__name__}: {error}"
        return value if inspect.isawaitable(value) else result_text(value)

    def _resolve(self, value):
        """A coroutine's result, on this episode's one event loop (state bound to it lives on)."""
        if not inspect.isawaitable(value):
            return value
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
        return self.loop.run_until_complete(value)


async def _settle_all(calls: list) -> list[str]:
    return await asyncio.gather(*(_settle(call) for call in calls))


async def _settle(call) -> str:
    try:
        return result_text(await call)
    except BaseException as error:  # noqa: BLE001 - the model reads what went wrong
        return f"error: {type(error).__name__}: {error}"


def _prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


def _die_with_parent(prctl) -> None:
    parent = os.getppid()
    if prctl is None:
        exit_when_orphaned(parent)  # watch for the server to go instead
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the server went before the line above
        os._exit(0)


# what an episode's client imports on first use besides openai and httpx themselves (openai loads its resources
# and types lazily, httpcore its transports): about 0.3 s of CPU in every episode's process otherwise (measured)
_CLIENT_MODULES = ("openai.types.chat", "httpcore._sync.http11", "httpcore._sync.connection_pool",
                   "httpcore._async.http11", "httpcore._async.connection_pool", "anyio._backends._asyncio")


def import_client_modules() -> None:
    """In the server, before it forks episodes: what their OpenAI clients import."""
    import importlib

    import openai

    for client in (openai.OpenAI, openai.AsyncOpenAI):
        client(api_key="-", base_url="http://127.0.0.1:1").chat.completions.create  # noqa: B018 - loads them
    for name in _CLIENT_MODULES:
        importlib.import_module(name)


def main(argv: list[str]) -> None:
    fd, parent_pid = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the worker to handle, not its children
    exit_when_orphaned(parent_pid)
    channel = socket.socket(fileno=fd)
    parent_path, spec, tool_specs = read_frame(fd)
    take_parent_path(parent_path)
    try:
        cls = load_environment(spec)
        harness = is_harness(cls)
        if harness:  # imported once here, not in every episode's process
            try:
                import_client_modules()
            except ImportError as error:
                raise EnvironmentLoadError(f"environment {spec!r} is an agent harness, whose client needs the "
                                           f"openai package ({error}): pip install 'rldsl[agents]'") from error
        tools = {} if harness else load_tools(tool_specs, cls)
        schemas = [tool_schema(fn) for fn in tools.values()]
    except EnvironmentLoadError as error:
        write_frame(fd, ("load_error", str(error)))
        return
    except BaseException as error:  # noqa: BLE001 - reported to the host, which raises it in the worker
        write_frame(fd, ("load_error", f"environment {spec!r}: {type(error).__name__}: {error}"))
        return
    write_frame(fd, ("ready", callable(getattr(cls, "close", None)), schemas, "harness" if harness else "class"))
    serve_forks(channel, cls, tools)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # the host went away
