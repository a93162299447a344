"""``ContinuousBatcher``: one generator replica serving many prompt groups at once.

A generation actor receives one ``generate`` call per prompt group, from
several threads at once. Decoding each group alone wastes the accelerator
(a group is a few rows); the batcher gathers the groups into one running
batch on a single decode thread, the only thread that touches the engine.

Three engine styles, told apart by the methods they have:

- stepwise (``admit`` / ``decode_step`` / ``finish_request`` /
  ``abort_requests`` / ``rows_in_flight``; the torch engine): requests join
  the running batch between decode steps and each leaves, its Batch returned
  to its caller, as soon as its own rows have ended;
- streaming (``start_group(request) -> concurrent.futures.Future`` and
  ``streams`` true; vLLM's ``AsyncLLM``, SGLang's async engine, the sim
  engine in a run): each request is handed to the engine the moment it is
  admitted and each is answered the moment its own future completes, so
  groups finish independently and out of order;
- whole-batch (``generate_groups(requests) -> list[Batch]``; vLLM's and
  SGLang's offline engines, a sim engine built without ``streaming``):
  every queued request goes into one call, requests arriving meanwhile into
  the next: a wave, whose groups all wait for its longest. A slot of the
  returned list may hold an exception: that request failed alone.

An engine with neither is driven through ``generate``, one request at a time.

Weights: ``update_weights`` only copies a bucket to host memory and returns,
so a push never stalls decoding. Once a version is complete the batcher
stops admitting, lets the rows in flight finish with the old weights,
applies the staged buckets in place through the engine's own
``update_weights`` and admits again: no sample mixes two versions, and
generation stops only for the in-place copy. Only the newest complete
version is applied. That is ``update = between_requests``. With ``update =
interrupt`` (engines that say ``interrupts``: torch, stepwise, at the next
decode-step boundary; vLLM, streaming, at once: it pauses its requests and
keeps them) a complete version is applied with the rows still in flight;
the engine resumes them under the new weights and records the version of
every token (AReaL's partial rollouts).
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from typing import Any, Callable, Mapping

from rldsl.runtime.engines.batch_requests import (
    UPDATE_BETWEEN_REQUESTS,
    UPDATE_INTERRUPT,
    UPDATE_MODES,
    Pending,
    Request,
    StagedVersion,
    future_outcome,
    host_copy,
    result_or_error,
    run_into,
)
from rldsl.runtime.protocols import Batch, Prompt


class ContinuousBatcher:
    """Serves concurrent ``submit`` calls from one running batch.

    ``max_rows`` caps the rows decoded together (None: no cap); a request
    larger than the cap still runs, alone. ``update``: when a complete weight
    version is applied (``between_requests`` or ``interrupt``, see above)."""

    def __init__(self, engine, max_rows: int | None = None, update: str = UPDATE_BETWEEN_REQUESTS):
        self.engine = engine
        self.max_rows = max_rows
        self._stepwise = all(hasattr(engine, name) for name in ("admit", "decode_step", "finish_request"))
        self._streaming = not self._stepwise and bool(getattr(engine, "streams", False))
        self._interrupts = _interrupt_mode(engine, update, self._stepwise or self._streaming)
        self._lock = threading.Condition()
        self._queue: deque[Pending] = deque()
        self._in_flight: dict[int, Pending] = {}  # stepwise engines: engine request id -> request
        self._streams: set[Pending] = set()  # streaming engines: requests the engine is decoding
        self._in_call = 0  # whole-batch engines: requests in the running call
        self._idle_calls: deque[tuple[Callable, Pending]] = deque()  # run between batches
        self._receiving: StagedVersion | None = None  # a version whose last bucket has not arrived
        self._ready: StagedVersion | None = None  # complete, waiting for the rows in flight
        self._weight_error: BaseException | None = None
        self._asleep = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stats = {"batches": 0, "max_rows": 0, "rows_decoded": 0, "requests": 0, "weight_swaps": 0,
                       "interrupts": 0}

    # -- callers ----------------------------------------------------------------------

    def submit(self, prompts: list[Prompt], samples_per_prompt: int, seed: int) -> Batch:
        """Block until this request's rows are decoded; rows prompt-major, one version."""
        if not prompts or samples_per_prompt < 1:
            raise ValueError("generate needs at least one prompt and samples_per_prompt >= 1")
        pending = Pending(list(prompts), samples_per_prompt, seed)
        with self._lock:
            self._require_open()
            if self._weight_error is not None:  # never sample on weights a push failed to replace
                raise RuntimeError(f"this replica could not apply its last weight push, so it generates no more "
                                   f"on the old weights: {self._weight_error}") from self._weight_error
            self._queue.append(pending)
            self._wake_decoder()
        return pending.wait()

    generate = submit  # the GenerationEngine protocol's name

    def update_weights(self, bucket: Mapping[str, Any], version: int, last: bool) -> None:
        """Stage a host copy of ``bucket`` and return; a complete version is
        applied once the rows in flight have finished."""
        copy = {name: host_copy(value) for name, value in bucket.items()}
        with self._lock:
            self._raise_weight_error()
            if self._receiving is None:
                self._receiving = StagedVersion(version)
            elif self._receiving.version != version:
                raise RuntimeError(
                    f"weight bucket for version {version} arrived while version {self._receiving.version} "
                    "was half staged; a push must finish (last=True) before the next begins")
            self._receiving.buckets.append(copy)
            if last:
                staged, self._receiving = self._receiving, None
                if self._ready is None or staged.version >= self._ready.version:
                    self._ready = staged  # a newer complete version replaces one not yet applied
                self._wake_decoder()

    def sleep(self) -> None:
        """Wait until no rows are in flight, then put the engine to sleep;
        requests submitted meanwhile wait for ``wake``."""
        self.run_idle(self._sleep_engine)

    def wake(self) -> None:
        self.run_idle(self._wake_engine)

    def refresh(self, buckets: list[Mapping[str, Any]], version: int) -> None:
        """Apply a whole version at once between batches (a replica that
        missed pushes while asleep); a staged version no newer is dropped.
        No buckets only sets the version (engines whose pushes carry none)."""
        with self._lock:
            self._raise_weight_error()
        self.run_idle(lambda engine: self._refresh_engine(buckets, version))

    @property
    def interrupts(self) -> bool:
        """Whether a staged version is applied with rows in flight (``update = interrupt``)."""
        return self._interrupts

    def run_idle(self, function: Callable[[Any], Any]) -> Any:
        """``function(engine)`` on the decode thread once no rows are in flight
        (e.g. greedy evaluation); its result, or its exception."""
        pending = Pending([], 0, 0)
        with self._lock:
            self._require_open()
            self._idle_calls.append((function, pending))
            self._wake_decoder()
        return pending.wait()

    def swap_in_engine(self, function: Callable[[Any], Any]) -> Any:
        """``function(engine)`` loads a version into the engine by itself (its
        workers receive it from the trainer): under ``update = interrupt`` at
        once, the engine pausing its requests in flight, else once no rows
        are in flight. Its result, or its exception."""
        if not self._interrupts:
            return self.run_idle(lambda engine: self._counted_swap(function, engine))
        with self._lock:
            self._raise_weight_error()
        return self._counted_swap(function, self.engine)

    def _counted_swap(self, function: Callable[[Any], Any], engine) -> Any:
        with self._lock:
            interrupting = bool(self._in_flight or self._streams)
        result = function(engine)
        with self._lock:
            self._stats["weight_swaps"] += 1
            self._stats["interrupts"] += interrupting
        return result

    def abort(self) -> int:
        """End the streams in flight now (engines with ``abort_requests``, e.g.
        vLLM): each is answered with the tokens it has. Returns how many."""
        with self._lock:
            streaming = bool(self._streams)
        if streaming and hasattr(self.engine, "abort_requests") and self._streaming:
            return int(self.engine.abort_requests() or 0)
        return 0

    def close(self) -> None:
        """Fail queued requests, finish the rows in flight and stop the decode thread."""
        with self._lock:
            self._closed = True
            while self._queue:
                self._queue.popleft().resolve(error=RuntimeError("the batcher was closed"))
            self._lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def version(self) -> int:
        """The weight version the engine decodes with."""
        return self.engine.version

    @property
    def staged_version(self) -> int | None:
        """The complete version waiting to be applied, if any."""
        with self._lock:
            return None if self._ready is None else self._ready.version

    def stats(self) -> dict[str, int]:
        """``batches`` (decode steps, engine calls or admissions), ``max_rows``
        (peak rows decoded together), ``rows_decoded`` (rows returned),
        ``requests``, ``weight_swaps``, ``interrupts`` (swaps with rows in
        flight), and ``queued`` / ``in_flight`` now."""
        with self._lock:
            in_flight = len(self._in_flight) + len(self._streams) + self._in_call
            return {**self._stats, "queued": len(self._queue), "in_flight": in_flight}

    # -- the decode thread --------------------------------------------------------------

    def _wake_decoder(self) -> None:
        """Start the decode thread on first use, and wake it (lock held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._decode_loop, name="continuous-batcher", daemon=True)
            self._thread.start()
        self._lock.notify_all()

    def _decode_loop(self) -> None:
        while True:
            work = self._next_work()
            if work is None:
                return
            try:
                work()
            except Exception as error:  # keep serving: fail only what was in flight
                self._fail_in_flight(error)

    def _next_work(self) -> Callable[[], None] | None:
        """Block until there is something to do; None once closed and drained."""
        with self._lock:
            while True:
                idle = not self._in_flight and not self._streams
                if idle and self._idle_calls:
                    function, pending = self._idle_calls.popleft()
                    return lambda: run_into(pending, function, self.engine)
                if self._ready is not None and not self._asleep and (idle or self._interrupts):
                    staged, self._ready = self._ready, None  # interrupt: at this decode-step boundary
                    return lambda: self._apply(staged)
                admitted = self._take_admissible()
                if admitted or (self._stepwise and self._in_flight):
                    return lambda: self._decode(admitted)
                if self._closed and not self._streams:  # streams in flight still resolve their callers
                    self._fail_idle_calls()
                    return None
                self._lock.wait()

    def _take_admissible(self) -> list[Pending]:
        """Queued requests that may join now (lock held): none while asleep,
        while a weight swap (between requests) or an idle call waits for the
        rows in flight."""
        swap_waits = self._ready is not None and not self._interrupts
        if self._asleep or swap_waits or self._idle_calls or self._closed:
            return []
        rows = sum(pending.rows for pending in [*self._in_flight.values(), *self._streams])
        admitted = []
        while self._queue and (self.max_rows is None or rows == 0 or rows + self._queue[0].rows <= self.max_rows):
            admitted.append(self._queue.popleft())
            rows += admitted[-1].rows
        return admitted

    def _decode(self, admitted: list[Pending]) -> None:
        try:
            if self._stepwise:
                self._admit(admitted)
                if self._in_flight:
                    self._step()
            elif self._streaming:
                self._start_streams(admitted)
            else:
                self._whole_batch(admitted)
        except Exception as error:  # a bug, not an engine error: no caller may wait forever
            for pending in admitted:
                if not pending.done.is_set():
                    pending.resolve(error=error)
            raise

    def _admit(self, admitted: list[Pending]) -> None:
        if not admitted:
            return
        try:
            request_ids = self.engine.admit([pending.request for pending in admitted])
        except Exception as error:
            if len(admitted) == 1:
                admitted[0].resolve(error=error)
                return
            for pending in admitted:  # one bad request must not fail the others: admit each alone
                self._admit([pending])
            return
        with self._lock:
            self._in_flight.update(zip(request_ids, admitted))

    def _step(self) -> None:
        self._count_batch(self.engine.rows_in_flight)
        try:
            ended = self.engine.decode_step()
        except Exception as error:
            self._fail_in_flight(error)
            return
        for request_id in ended:
            with self._lock:
                pending = self._in_flight.pop(request_id)
            try:
                batch = self.engine.finish_request(request_id)
            except Exception as error:
                result_or_error(self.engine.abort_requests, [request_id])
                pending.resolve(error=error)
                continue
            self._deliver(pending, batch)

    def _start_streams(self, admitted: list[Pending]) -> None:
        """Hand each request to the engine now; its future's completion answers it."""
        with self._lock:
            self._streams.update(admitted)
            rows = sum(pending.rows for pending in self._streams)
        self._count_batch(rows)
        for pending in admitted:
            try:
                future = self.engine.start_group(pending.request)
            except Exception as error:
                self._stream_ended(pending, None, error)
                continue
            future.add_done_callback(functools.partial(self._finish_stream, pending))

    def _finish_stream(self, pending: Pending, future) -> None:
        """A streamed request's future completed (on the engine's thread)."""
        self._stream_ended(pending, *future_outcome(future))

    def _stream_ended(self, pending: Pending, batch: Batch | None, error: BaseException | None) -> None:
        with self._lock:
            self._streams.discard(pending)
            self._lock.notify_all()  # a swap or an idle call may wait for the streams to drain
        if error is not None:
            pending.resolve(error=error)
        else:
            self._deliver(pending, batch)

    def _whole_batch(self, admitted: list[Pending]) -> None:
        self._count_batch(sum(pending.rows for pending in admitted))
        with self._lock:
            self._in_call = len(admitted)
        try:
            results = self._generate_groups([pending.request for pending in admitted])
            if len(results) != len(admitted):
                raise RuntimeError(f"generate_groups returned {len(results)} batches for {len(admitted)} requests")
        except Exception as error:
            results = [error] * len(admitted)
        finally:
            with self._lock:
                self._in_call = 0
        for pending, result in zip(admitted, results):
            if isinstance(result, BaseException):
                pending.resolve(error=result)
            else:
                self._deliver(pending, result)

    def _generate_groups(self, requests: list[Request]) -> list:
        if hasattr(self.engine, "generate_groups"):
            return self.engine.generate_groups(requests)
        return [result_or_error(self.engine.generate, *request) for request in requests]

    def _deliver(self, pending: Pending, batch: Batch) -> None:
        with self._lock:
            self._stats["rows_decoded"] += pending.rows
            self._stats["requests"] += 1
        pending.resolve(result=batch)

    def _count_batch(self, rows: int) -> None:
        with self._lock:
            self._stats["batches"] += 1
            self._stats["max_rows"] = max(self._stats["max_rows"], rows)

    def _fail_in_flight(self, error: BaseException) -> None:
        with self._lock:
            failed, self._in_flight = list(self._in_flight.values()), {}
        if self._stepwise:  # the requests fail with the original error even if this raises
            result_or_error(self.engine.abort_requests, None)
        for pending in failed:
            pending.resolve(error=error)

    def _fail_idle_calls(self) -> None:
        while self._idle_calls:
            self._idle_calls.popleft()[1].resolve(error=RuntimeError("the batcher was closed"))

    # -- weights and sleep (decode thread, nothing in flight) -----------------------------

    def _apply(self, staged: StagedVersion) -> None:
        try:
            with self._lock:
                interrupting = bool(self._in_flight or self._streams)
            self._apply_buckets(staged.buckets, staged.version)
            if interrupting:
                with self._lock:
                    self._stats["interrupts"] += 1
        except Exception as error:  # nobody waits for a staged push: the next push and every request hear of it
            with self._lock:
                self._weight_error = error

    def _apply_buckets(self, buckets: list, version: int) -> None:
        for index, bucket in enumerate(buckets):
            self.engine.update_weights(bucket, version, index == len(buckets) - 1)
        if not buckets:
            self.engine.version = version
        with self._lock:
            self._stats["weight_swaps"] += 1

    def _refresh_engine(self, buckets: list, version: int) -> None:
        self._apply_buckets(buckets, version)
        with self._lock:
            if self._ready is not None and self._ready.version <= version:
                self._ready = None

    def _sleep_engine(self, engine) -> None:
        engine.sleep()
        with self._lock:
            self._asleep = True

    def _wake_engine(self, engine) -> None:
        engine.wake()
        with self._lock:
            self._asleep = False

    def _raise_weight_error(self) -> None:
        """Re-raise, once, the error of a staged version that failed to apply (lock held)."""
        error, self._weight_error = self._weight_error, None
        if error is not None:
            raise RuntimeError(f"applying staged weights failed: {error}") from error

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("the batcher was closed")


def _interrupt_mode(engine, update: str, incremental: bool) -> bool:
    """Whether staged versions interrupt decoding; refuses an engine that cannot resume its rows."""
    if update not in UPDATE_MODES:
        raise ValueError(f"update = {update!r}: expected one of {', '.join(UPDATE_MODES)}")
    if update == UPDATE_INTERRUPT and not (incremental and getattr(engine, "interrupts", False)):
        raise ValueError(f"update = interrupt needs an engine that resumes its rows under new weights "
                         f"(torch, vLLM); {type(engine).__name__} cannot: use update = between_requests")
    return update == UPDATE_INTERRUPT
