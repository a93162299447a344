"""The requests a ``ContinuousBatcher`` holds and the small helpers it runs them with."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from rldsl.runtime.protocols import Prompt

Request = tuple[list[Prompt], int, int]  # (prompts, samples_per_prompt, seed)

UPDATE_BETWEEN_REQUESTS = "between_requests"  # a sample is decoded with one weight version
UPDATE_INTERRUPT = "interrupt"  # a version is applied at the next decode step; samples record per-token versions
UPDATE_MODES = (UPDATE_BETWEEN_REQUESTS, UPDATE_INTERRUPT)


@dataclass(eq=False)
class Pending:
    """One submitted request and the caller waiting for it."""

    prompts: list[Prompt]
    samples_per_prompt: int
    seed: int
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.samples_per_prompt

    @property
    def request(self) -> Request:
        return self.prompts, self.samples_per_prompt, self.seed

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()

    def wait(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


@dataclass
class StagedVersion:
    version: int
    buckets: list[dict] = field(default_factory=list)


def host_copy(value: Any) -> Any:
    """A host-memory clone of a tensor (the sender may reuse its buffer); other values as they are."""
    if hasattr(value, "detach"):
        return value.detach().to("cpu", copy=True)
    return value


def result_or_error(function: Callable, *args) -> Any:
    try:
        return function(*args)
    except Exception as error:
        return error


def run_into(pending: Pending, function: Callable, engine) -> None:
    try:
        pending.resolve(result=function(engine))
    except Exception as error:
        pending.resolve(error=error)


def future_outcome(future) -> tuple[Any, BaseException | None]:
    """A finished ``concurrent.futures.Future``'s result, or its error (a cancelled one included)."""
    try:
        return future.result(), None
    except BaseException as error:  # CancelledError is a BaseException
        return None, error


def token_version_runs(token_versions, response_mask=None) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each row's per-token versions ([rows, T]) as ``(version, tokens)`` runs
    in order, over the row's response tokens when ``response_mask`` is given;
    () for None (every token the row's version)."""
    if token_versions is None or len(token_versions) == 0:
        return ()
    rows = token_versions.tolist()
    lengths = [len(row) for row in rows] if response_mask is None else response_mask.sum(dim=1).tolist()
    return tuple(_runs(row[: int(length)]) for row, length in zip(rows, lengths))


def _runs(versions: list[int]) -> tuple[tuple[int, int], ...]:
    runs: list[list[int]] = []
    for version in versions:
        if runs and runs[-1][0] == version:
            runs[-1][1] += 1
        else:
            runs.append([int(version), 1])
    return tuple((version, steps) for version, steps in runs)
