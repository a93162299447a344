"""StageHandles over Ray actors, built inside the controller actor.

Generators hold one prompt group at a time (a pool of idle ones), reward
ranks are used round-robin, logprob replicas too (every tp rank of a replica
computes, its first writes), the trainer's ranks all take part in begin /
finish / abort while each microbatch goes to one data-parallel replica.
Weights travel as one object per bucket: put once by the trainer, read by
every receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Sequence

from rldsl.runtime.control.controller import StageHandles


class _Pool:
    """Idle actors of one stage; ``take`` waits for a free one."""

    def __init__(self, actors: list):
        self.idle: asyncio.Queue = asyncio.Queue()
        for actor in actors:
            self.idle.put_nowait(actor)

    async def call(self, method: str, *args):
        actor = await self.idle.get()
        try:
            return await getattr(actor, method).remote(*args)
        finally:
            self.idle.put_nowait(actor)


def ray_stage_handles(workers: dict[str, list], kinds: dict[str, str], receivers: list, bucket_bytes: int,
                      train_stage: str, replicas: dict[str, list[list[int]]],
                      sleepers: list | None = None, observers: list | None = None, tracer=None) -> StageHandles:
    """``workers``: stage name -> actor handles (one per rank); ``kinds``:
    stage name -> stage kind; ``receivers``: the actors on sync edges;
    ``replicas``: for the trainer and each logprob stage, the rank indices
    of each data-parallel replica (the tp x pp ranks that must all see the
    same rows); ``sleepers``: the generators sharing GPUs with the trainer,
    put to sleep while it trains; ``observers``: weight receivers the push
    does not wait for (the evaluator: it must never hold up generation);
    ``tracer``: records each weight push as a span."""
    generators = [a for name, actors in workers.items() if kinds[name] == "generate" for a in actors]
    pool = _Pool(generators)
    round_robin = {name: itertools.cycle(actors) for name, actors in workers.items()}
    next_replica = {name: itertools.cycle([[workers[name][i] for i in ranks] for ranks in groups])
                    for name, groups in replicas.items()}
    trainers = workers[train_stage]

    async def generate(prompts: Sequence, keys: Sequence[str], samples_per_prompt: int, seed: int) -> int:
        return await pool.call("generate", list(prompts), list(keys), samples_per_prompt, seed)

    async def reward(stage: str, keys: Sequence[str]):
        return await next(round_robin[stage]).reward.remote(list(keys))

    async def logprob(stage: str, keys: Sequence[str]) -> None:
        await asyncio.gather(*(a.logprob.remote(list(keys)) for a in next(next_replica[stage])))

    async def begin_train_step(step: int) -> None:
        await asyncio.gather(*(t.begin_train_step.remote(step) for t in trainers))

    async def train_microbatch(step: int, keys: Sequence[str]):
        results = await asyncio.gather(*(t.train_microbatch.remote(step, list(keys))
                                         for t in next(next_replica[train_stage])))
        return next((r for r in results if r), results[0])  # pipeline stages without the loss report nothing

    async def finish_train_step(step: int):
        results = await asyncio.gather(*(t.finish_train_step.remote(step) for t in trainers))
        return results[0]

    async def abort_train_step(step: int) -> None:
        await asyncio.gather(*(t.abort_train_step.remote(step) for t in trainers), return_exceptions=True)

    async def push_weights(version: int) -> None:
        with tracer.span("weight push", version=version) if tracer else contextlib.nullcontext():
            await _push(version)

    async def _push(version: int) -> None:
        # every rank takes part (gathering TP/PP shards is a collective); rank 0 serves the buckets
        count = (await asyncio.gather(*(t.prepare_buckets.remote(bucket_bytes) for t in trainers)))[0]
        for index in range(count):
            bucket = trainers[0].bucket.remote(index)  # an ObjectRef: stored once, read by every receiver
            last = index == count - 1
            for observer in observers or ():  # in order per caller, so its buckets arrive in sequence
                observer.update_weights.remote(bucket, version, last)
            await asyncio.gather(*(r.update_weights.remote(bucket, version, last) for r in receivers))

    async def generator_version() -> int:
        return await generators[0].version.remote()

    async def sleep_generators() -> None:
        """The train phase: generators release the GPUs, an offloaded trainer takes them back."""
        await asyncio.gather(*(g.sleep.remote() for g in sleepers or ()))
        if sleepers:
            await asyncio.gather(*(t.wake.remote() for t in trainers))

    async def wake_generators() -> None:
        """The generation phase: the trainer offloads (if it does), generators wake."""
        if sleepers:
            await asyncio.gather(*(t.sleep.remote() for t in trainers))
        await asyncio.gather(*(g.wake.remote() for g in sleepers or ()))

    return StageHandles(generate, reward, logprob, begin_train_step, train_microbatch, finish_train_step,
                        abort_train_step, push_weights, generator_version, sleep_generators, wake_generators)
