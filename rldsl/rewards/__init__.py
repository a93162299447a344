"""Reward functions and the guard that runs user rewards safely.

A reward is ``fn(response, answer, prompt) -> float``. Pipelines name one as
``"module:function"``, or several as named components summed with weights
(``WeightedRewards``); ``load_reward`` resolves them with messages that say
what is wrong. ``code_tests`` scores code in a sandbox (``sandbox.py``);
``gsm8k``, ``gsm8k_strict``, ``math`` and ``boxed_match`` check final
answers (``verifiers.py``).
``safe_reward`` turns a reward that raises, hangs or returns a
non-number into a dropped sample with a reason, in this process; a run's
reward workers isolate rewards in processes instead
(``rldsl.runtime.reward_pool``).
"""

from __future__ import annotations

import difflib
import importlib
import sys
import threading
from math import isfinite
from typing import Callable

from rldsl.rewards.code import code_tests
from rldsl.rewards.verifiers import boxed_match, gsm8k, gsm8k_strict, math

__all__ = ["RewardLoadError", "WeightedRewards", "boxed_match", "char_match", "code_tests", "digit_match",
           "exact_match", "gsm8k", "gsm8k_strict", "load_reward", "math", "safe_reward"]

RewardFn = Callable[[str, str, str], float]


def exact_match(response: str, answer: str, prompt: str = "") -> float:
    """1.0 when the response equals the answer, ignoring surrounding whitespace."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def char_match(response: str, answer: str, prompt: str = "") -> float:
    """Partial credit in [0, 1]: characters equal at the same position,
    divided by the longer length (so extra or missing characters cost)."""
    response, answer = response.strip(), answer.strip()
    longest = max(len(response), len(answer))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, answer)) / longest


digit_match = char_match  # the name arithmetic users look for


class RewardLoadError(ValueError):
    pass


class WeightedRewards:
    """A reward stage's named components: the reward is their weighted sum,
    and ``parts`` gives each component's own value (logged as ``reward/<name>``)."""

    def __init__(self, components: list[tuple[str, RewardFn, float]]):
        self.components = components

    def parts(self, response: str, answer: str, prompt: str) -> dict[str, float]:
        """Each component's value; a component that fails raises, naming itself."""
        values = {}
        for name, fn, _ in self.components:
            try:
                value = fn(response, answer, prompt)
            except Exception as error:
                raise RewardComponentError(f"component {name!r}: {type(error).__name__}: {error}") from error
            number, problem = checked_reward(value)
            if problem:
                raise RewardComponentError(f"component {name!r}: {problem}")
            values[name] = number
        return values

    def total(self, parts: dict[str, float]) -> float:
        return sum(weight * parts[name] for name, _, weight in self.components)

    def __call__(self, response: str, answer: str, prompt: str = "") -> float:
        return self.total(self.parts(response, answer, prompt))


class RewardComponentError(ValueError):
    """One component of a weighted reward failed; its sample is dropped."""


def load_reward(spec) -> RewardFn:
    """Resolve ``"package.module:function"`` to a callable; a ``@DIR`` suffix
    (the plan adds it for a module beside the pipeline file) is searched first.
    A list of ``{"name", "fn", "weight"}`` (a stage's named components) gives
    a ``WeightedRewards``."""
    if isinstance(spec, (list, tuple)):
        return WeightedRewards([(part["name"], load_reward(part["fn"]), float(part["weight"])) for part in spec])
    spec, _, directory = spec.partition("@")
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise RewardLoadError(f"reward {spec!r}: expected 'module:function', e.g. 'rldsl.rewards:exact_match'")
    if directory and directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        where = f"beside the pipeline file in {directory}" if directory else \
            "installed, on PYTHONPATH, or beside the pipeline file"
        raise RewardLoadError(f"reward {spec!r}: cannot import module {module_name!r} ({where}): {error}") from error
    function = getattr(module, function_name, None)
    if function is None:
        public = [name for name in dir(module) if not name.startswith("_")]
        close = difflib.get_close_matches(function_name, public, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise RewardLoadError(f"reward {spec!r}: module {module_name!r} has no function {function_name!r}{hint}")
    if not callable(function):
        raise RewardLoadError(f"reward {spec!r}: {function_name!r} is a {type(function).__name__}, not a function")
    return function


def safe_reward(
    fn: RewardFn, response: str, answer: str, prompt: str, timeout_s: float | None = None
) -> tuple[float | None, str | None]:
    """``(value, None)`` on success, ``(None, reason)`` when the sample must be dropped.

    With a timeout the reward runs in a daemon thread; a reward that overruns
    is abandoned (Python cannot kill a thread), its sample dropped, and the
    caller is never blocked longer than ``timeout_s``.
    """
    if timeout_s is None:
        outcome = _call(fn, response, answer, prompt)
    else:
        outcome = _call_with_timeout(fn, (response, answer, prompt), timeout_s)
        if outcome is None:
            return None, f"reward timed out after {timeout_s:g}s"
    value, error = outcome
    if error is not None:
        return None, f"reward raised {type(error).__name__}: {error}"
    return checked_reward(value)


def _call(fn, *args):
    try:
        return fn(*args), None
    except Exception as error:  # noqa: BLE001 - any failure drops only this sample
        return None, error


def _call_with_timeout(fn, args, timeout_s: float):
    result = []
    worker = threading.Thread(target=lambda: result.append(_call(fn, *args)), daemon=True)
    worker.start()
    worker.join(timeout_s)
    return result[0] if result else None


def checked_reward(value) -> tuple[float | None, str | None]:
    """``(float, None)`` for a finite number, else ``(None, what it was)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy / torch scalars
        except (TypeError, ValueError):
            return None, f"reward returned {type(value).__name__}, not a number"
    value = float(value)
    if not isfinite(value):
        return None, f"reward returned {value}"
    return value, None
