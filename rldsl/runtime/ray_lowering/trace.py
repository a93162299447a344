"""A trace of the run: every stage call as a span on the actor that ran it.

Each actor keeps a ``Tracer``: a span is one tuple appended to a list (a
couple of microseconds), so tracing stays on by default (``RLDSL_TRACE=0``
turns it off). The driver drains every actor every few seconds without
waiting for them (``TraceCollector``), appends what it gets to
``trace-events.jsonl`` in the run directory, and at the end, on every exit
path, writes ``trace.json`` in the Chrome trace-event format that Perfetto
and ``chrome://tracing`` open as is (trace_format.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from rldsl.runtime.ray_lowering.actor_process import OBSERVE

TRACE_ENV = "RLDSL_TRACE"
EVENTS_FILE = "trace-events.jsonl"
TRACE_FILE = "trace.json"
_DRAIN_EVERY_S = 2.0


def tracing_enabled() -> bool:
    return os.environ.get(TRACE_ENV, "1") != "0"


def prompt_groups(keys: Sequence[str]) -> list[int]:
    """The prompt indices of sample keys (`pipeline/p<prompt>/s<sample>`): the group keys of a call."""
    groups = set()
    for key in keys:
        part = key.rsplit("/", 2)[-2] if key.count("/") >= 2 else ""
        if part.startswith("p") and part[1:].isdigit():
            groups.add(int(part[1:]))
    return sorted(groups)


class Tracer:
    """The spans of one actor, kept until drained. Thread-safe (the
    evaluator serves several calls at once)."""

    def __init__(self, actor: str, stage: str, kind: str, rank: int | None = None, gpus: Sequence[int] = (),
                 node: int | None = None) -> None:
        self.meta = {"actor": actor, "stage": stage, "kind": kind, "rank": rank, "gpus": list(gpus), "node": node,
                     "pid": os.getpid()}
        self.enabled = tracing_enabled()
        self._events: list[tuple] = []
        self._lock = threading.Lock()

    @contextmanager
    def span(self, name: str, **args) -> Iterator[dict]:
        """Record ``name`` from entry to exit; the yielded dict takes args known
        only at the end (a version, a count). An exception is recorded too."""
        if not self.enabled:
            yield args
            return
        start = time.time_ns()
        try:
            yield args
        except BaseException as error:
            args["error"] = type(error).__name__
            raise
        finally:
            end = time.time_ns()
            with self._lock:
                self._events.append((name, start // 1000, max(1, (end - start) // 1000), args))

    def drain(self) -> dict:
        with self._lock:
            events, self._events = self._events, []
        return {"actor": self.meta, "events": events}


class TraceCollector:
    """Drains the actors' tracers into the run directory, never blocking the
    driver: a drain is sent, and its answer collected on a later poll."""

    def __init__(self, run_dir: Path, actors: dict[str, object], pipeline: str) -> None:
        self.run_dir, self.actors, self.pipeline = run_dir, dict(actors), pipeline
        self.enabled = tracing_enabled()
        self._pending: dict[object, str] = {}  # drain ref -> actor name
        self._last = 0.0
        self.failed: str | None = None  # why the trace stopped being written (a full run directory)

    def replace(self, name: str, actor) -> None:
        """A dead actor's replacement: drained under the same name from now on."""
        self.actors[name] = actor

    def poll(self) -> None:
        import ray

        if not self.enabled:
            return
        self._collect(ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)[0]
                      if self._pending else [])
        if time.monotonic() - self._last < _DRAIN_EVERY_S:
            return
        self._last = time.monotonic()
        self._send_drains()

    def close(self, timeout_s: float = 10.0) -> Path | None:
        """A last drain of every actor still alive, then ``trace.json``."""
        import ray

        if not self.enabled:
            return None
        from rldsl.runtime.ray_lowering.trace_format import write_chrome_trace
        from rldsl.runtime.run_files import RunDirectoryError

        try:
            self._send_drains()
            deadline = time.monotonic() + timeout_s
            while self._pending and time.monotonic() < deadline:
                ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending),
                                    timeout=max(0.0, deadline - time.monotonic()))
                self._collect(ready)
            return write_chrome_trace(self.run_dir / EVENTS_FILE, self.run_dir / TRACE_FILE, self.pipeline)
        except (OSError, RunDirectoryError) as error:  # a full disk: the run's own error is the one to report
            self.failed = self.failed or str(error)
            return None

    def _send_drains(self) -> None:
        """Ask every actor without a drain in flight for its spans."""
        busy = set(self._pending.values())
        for name, actor in self.actors.items():
            if name not in busy:
                self._pending[actor.trace.options(concurrency_group=OBSERVE).remote()] = name

    def _collect(self, ready: list) -> None:
        import ray

        batches = []
        for ref in ready:
            self._pending.pop(ref, None)
            try:
                answer = ray.get(ref)
            except ray.exceptions.RayError:  # a dead actor's spans since its last drain are lost, nothing else
                continue
            batches += [b for b in (answer if isinstance(answer, list) else [answer]) if b["events"]]
        if batches:
            from rldsl.runtime.run_files import RunDirectoryError, append_text

            try:
                append_text(self.run_dir / EVENTS_FILE, "".join(json.dumps(batch) + "\n" for batch in batches),
                            sync=False)
            except RunDirectoryError as error:  # the trace is an aid: the run goes on, and says so at its end
                self.enabled, self.failed = False, str(error)
