"""vLLM's ``AsyncLLM`` for the streaming generator (``vllm.create_async_llm``).

``AsyncLLMBridge`` runs the async engine on an event-loop thread of its own
and offers the offline ``LLM``'s methods the vLLM engines call, so weight
sync, sleep and greedy evaluation work unchanged; ``submit_generate``
returns at once with a future, which ``VLLMGenerator.start_group`` turns
into a group's batch. vLLM is imported only when an engine is built.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import Future

from rldsl.runtime.engines.serving import EventLoopThread


class AsyncLLMBridge:
    """``AsyncLLM`` with the offline ``LLM``'s methods the engines call
    (``generate``, ``collective_rpc``, ``reset_prefix_cache``, ``sleep``,
    ``wake_up``), each run on the loop thread; ``submit_generate`` returns
    at once with a future of the outputs."""

    def __init__(self, engine, loop: EventLoopThread) -> None:
        self.engine, self.loop = engine, loop
        self._ids = itertools.count()

    def submit_generate(self, inputs: list[dict], params) -> Future:
        """Every prompt as its own request, concurrently; a future of their final outputs, in order."""
        params = params if isinstance(params, list) else [params] * len(inputs)
        return self.loop.submit(self._generate(inputs, params))

    def generate(self, inputs: list[dict], params, use_tqdm: bool = False) -> list:
        return self.submit_generate(inputs, params).result()

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return self.loop.run(self.engine.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> None:
        self.loop.run(self.engine.reset_prefix_cache())

    def sleep(self, level: int = 1) -> None:
        self.loop.run(self.engine.sleep(level))

    def wake_up(self) -> None:
        self.loop.run(self.engine.wake_up())

    async def _generate(self, inputs: list[dict], params: list) -> list:
        return list(await asyncio.gather(*(self._one(prompt, sampling) for prompt, sampling in zip(inputs, params))))

    async def _one(self, prompt: dict, sampling):
        final = None
        async for output in self.engine.generate(prompt, sampling, request_id=f"rldsl-{next(self._ids)}"):
            final = output  # cumulative outputs: the last holds every token
        return final
