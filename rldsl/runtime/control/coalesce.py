"""Joining the prompt groups that wait for a busy stage into one call.

Generation batches many groups, so they reach the reward and logprob
stages in bursts. Calling such a stage once per group pays its fixed cost
(a remote call, a data-plane get and put, a small forward) per group and
leaves the groups queued behind one another anyway. A ``CoalescedStage``
lets at most ``slots`` calls run at once (one per worker behind the stage);
the groups that arrive while every slot is busy wait and go together in
the next call. A lone group is never held back: with a slot free it is
sent at once, so coalescing adds no latency.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Sequence

StageCall = Callable[[list[str]], Awaitable[Sequence[Any] | None]]


class CoalescedStage:
    """One stage's calls, at most ``slots`` at a time, waiting requests merged.

    ``call(keys)`` returns one result per key (rewards) or None (logprobs);
    each request gets back its own slice. A failed call fails every request
    it carried, as it would have failed each of them alone."""

    def __init__(self, call: StageCall, slots: int, max_keys: int) -> None:
        if slots < 1 or max_keys < 1:
            raise ValueError(f"CoalescedStage needs slots >= 1 and max_keys >= 1, got {slots}, {max_keys}")
        self._call = call
        self._slots = slots
        self._max_keys = max_keys
        self._waiting: list[tuple[list[str], asyncio.Future]] = []
        self._running = 0
        self.calls = 0  # calls made: how much the merging saved shows against the requests

    async def __call__(self, keys: Sequence[str]) -> list[Any] | None:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((list(keys), future))
        self._start_calls()
        return await future

    def _start_calls(self) -> None:
        while self._waiting and self._running < self._slots:
            batch = self._take_batch()
            self._running += 1
            self.calls += 1
            asyncio.create_task(self._run(batch))

    def _take_batch(self) -> list[tuple[list[str], asyncio.Future]]:
        """The oldest waiting requests up to ``max_keys`` keys (always at least one)."""
        batch, size = [], 0
        while self._waiting and (not batch or size + len(self._waiting[0][0]) <= self._max_keys):
            request = self._waiting.pop(0)
            batch.append(request)
            size += len(request[0])
        return batch

    async def _run(self, batch: list[tuple[list[str], asyncio.Future]]) -> None:
        try:
            results = await self._call([key for keys, _ in batch for key in keys])
        except Exception as error:  # noqa: BLE001 - handed to every request it carried
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
        else:
            self._hand_out(batch, results)
        finally:
            self._running -= 1
            self._start_calls()

    @staticmethod
    def _hand_out(batch: list[tuple[list[str], asyncio.Future]], results: Sequence[Any] | None) -> None:
        total = sum(len(keys) for keys, _ in batch)
        if results is not None and len(results) != total:
            error = ValueError(f"{len(results)} results for {total} samples")
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        start = 0
        for keys, future in batch:
            if not future.done():  # a cancelled waiter (a stopping run) just loses its slice
                future.set_result(None if results is None else list(results[start:start + len(keys)]))
            start += len(keys)
