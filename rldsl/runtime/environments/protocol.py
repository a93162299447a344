"""The environment protocol and the checks on what an environment returns.

An agent harness is a function ``harness(client, prompt, answer) -> reward``
(plain or ``async``): it runs the whole episode, calling the model through
``client`` (an OpenAI client on the replica's endpoint), and returns the
episode's reward (``harness.py``).

An environment is a class named ``"module:Class"``, built with no arguments
once per episode, in a process of the episode's own that keeps the instance
until the episode ends (so it may hold anything: a subprocess, a socket, a
sandbox); each method may be a coroutine function:

- ``reset(prompt, answer) -> messages``: the conversation the model first
  answers, a list of ``{"role": ..., "content": ...}`` dicts;
- ``step(messages, completion) -> (observation, reward, done)``: the model's
  completion of this turn (text) given the conversation so far; the
  observation (a string, sent as a user turn, or a message dict such as
  ``{"role": "tool", "content": ...}``) is the next turn's input, unless
  ``done``. The episode's reward is the sum of its steps' rewards;
- ``close()``, optional: called once when the episode ends.

An OpenEnv environment class (openenv_adapter.py) is wrapped into such a
class; a verifiers taskset (verifiers_adapter.py) into an agent harness.

No torch here: the environment processes import this module.
"""

from __future__ import annotations

import difflib
import enum
import importlib
import inspect
import math
import sys
from typing import Protocol, runtime_checkable

from rldsl.runtime.environments.openenv_adapter import OpenEnvShapeError, adapt_openenv, is_openenv_environment


@runtime_checkable
class Environment(Protocol):
    def reset(self, prompt: str, answer: str) -> list[dict]: ...

    def step(self, messages: list[dict], completion: str) -> tuple[str | dict, float, bool]: ...


class EpisodeStatus(enum.IntEnum):
    """How an episode ended (the ``episode_status`` field); all but OK drop the sample."""

    OK = 0
    RAISED = 1  # reset or step raised, or returned something malformed
    TIMEOUT = 2  # a call overran the environment's timeout; its process was killed
    DIED = 3  # the process running a call died
    # an agent harness sent a conversation that does not extend the tokens so far (it rewrote earlier turns);
    # runs from before turns were kept as tokens also failed so when the re-encoded text differed
    TOKENIZATION = 4
    STRAGGLER = 5  # a call ran far longer than the environment's usual (its `straggler`); its process was killed


DROP_REASONS = {EpisodeStatus.RAISED: "environment_raised", EpisodeStatus.TIMEOUT: "environment_timeout",
                EpisodeStatus.DIED: "environment_died", EpisodeStatus.TOKENIZATION: "environment_tokenization",
                EpisodeStatus.STRAGGLER: "environment_straggler"}


# The header an agent harness's client names its episode in, on every request to the replica's endpoint.
EPISODE_HEADER = "X-Rldsl-Episode"


class EnvironmentLoadError(ValueError):
    pass


class EnvironmentProtocolError(ValueError):
    """An environment returned something the protocol does not allow."""


def load_environment(spec: str):
    """``"module:Class"`` (with the plan's ``@DIR`` suffix for a module beside
    the pipeline file) -> the class, with messages that say what is wrong."""
    spec, _, directory = spec.partition("@")
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise EnvironmentLoadError(f"environment {spec!r}: expected 'module:Class', "
                                   "e.g. 'rldsl.environments:ArithRetry'")
    if directory and directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise EnvironmentLoadError(f"environment {spec!r}: cannot import module {module_name!r}: {error}") from error
    cls = getattr(module, class_name, None)
    if cls is None:
        close = difflib.get_close_matches(class_name, [n for n in dir(module) if not n.startswith("_")], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise EnvironmentLoadError(f"environment {spec!r}: module {module_name!r} has no {class_name!r}{hint}")
    if is_harness(cls):
        return cls
    if is_openenv_environment(cls):
        try:
            return adapt_openenv(cls)
        except OpenEnvShapeError as error:
            raise EnvironmentLoadError(f"environment {spec!r} (OpenEnv): {error}") from None
    if is_verifiers_taskset(cls):
        from rldsl.runtime.environments.verifiers_adapter import adapt_verifiers

        try:
            return adapt_verifiers(cls)
        except ValueError as error:
            raise EnvironmentLoadError(f"environment {spec!r} (verifiers): {error}") from None
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if not isinstance(cls, type) or missing:
        lacks = f"lacks {', '.join(missing)}" if isinstance(cls, type) else f"is a {type(cls).__name__}"
        raise EnvironmentLoadError(f"environment {spec!r}: expected a class with reset(prompt, answer) and "
                                   f"step(messages, completion), or an agent harness, a function "
                                   f"harness(client, prompt, answer); {class_name!r} {lacks}")
    return cls


VERIFIERS_TASKSET = ("verifiers.v1.taskset", "Taskset")


def is_verifiers_taskset(cls) -> bool:
    """A verifiers taskset class (verifiers_adapter.py), told by its bases: nothing imports verifiers here."""
    return isinstance(cls, type) and any((base.__module__, base.__qualname__) == VERIFIERS_TASKSET
                                         for base in cls.__mro__[1:])


def is_harness(fn) -> bool:
    """An agent harness: a function (or coroutine function) ``(client, prompt, answer) -> reward``."""
    if isinstance(fn, type) or not inspect.isfunction(fn):
        return False
    parameters = list(inspect.signature(fn).parameters)
    return parameters[:1] == ["client"] and len(parameters) >= 3


def load_tools(specs, cls) -> dict:
    """The tools an episode may call, by name: the ``"module:function"``
    specs (the environment block's ``tools``) and the environment class's
    own ``tools`` attribute (a list of functions)."""
    functions = list(getattr(cls, "tools", None) or [])
    for spec in specs:
        module_name, _, directory = spec.partition("@")
        module_name, sep, name = module_name.partition(":")
        if directory and directory not in sys.path:
            sys.path.insert(0, directory)
        try:
            fn = getattr(importlib.import_module(module_name), name, None) if sep else None
        except ImportError as error:
            raise EnvironmentLoadError(f"tool {spec!r}: cannot import module {module_name!r}: {error}") from error
        if not callable(fn):
            raise EnvironmentLoadError(f"tool {spec!r}: expected 'module:function' naming a function")
        functions.append(fn)
    tools = {}
    for fn in functions:
        if not callable(fn) or fn.__name__ in tools:
            raise EnvironmentLoadError(f"tools must be functions with distinct names; {fn!r:.80} is "
                                       + ("named twice" if callable(fn) else "not one"))
        tools[fn.__name__] = fn
    return tools


def checked_messages(value) -> list[dict]:
    if not isinstance(value, list) or not value or not all(_is_message(m) for m in value):
        raise EnvironmentProtocolError(f"reset must return a non-empty list of {{'role': str, 'content': str}} dicts, "
                                f"not {value!r:.200}")
    return [_message(m) for m in value]


def checked_step(value) -> tuple[dict, float, bool]:
    """``(observation message, reward, done)`` from what ``step`` returned."""
    if not isinstance(value, tuple) or len(value) != 3:
        raise EnvironmentProtocolError(f"step must return (observation, reward, done), not {value!r:.200}")
    observation, reward, done = value
    if isinstance(observation, str):
        observation = {"role": "user", "content": observation}
    if not _is_message(observation):
        raise EnvironmentProtocolError(f"step's observation must be a string or a {{'role', 'content'}} dict, "
                                f"not {observation!r:.200}")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvironmentProtocolError(f"step's reward must be a number, not {reward!r:.100}") from None
    if not math.isfinite(reward):
        raise EnvironmentProtocolError(f"step's reward must be finite, not {reward}")
    return _message(observation), reward, bool(done)


_MESSAGE_KEYS = ("role", "content", "name", "tool_call_id", "tool_calls")  # what chat templates read


def _message(value: dict) -> dict:
    return {key: value[key] for key in _MESSAGE_KEYS if key in value}


def _is_message(value) -> bool:
    return isinstance(value, dict) and isinstance(value.get("role"), str) and isinstance(value.get("content"), str)
