"""StageHandles over Ray actors, built inside the controller actor.

Generator replicas are threaded actors that batch the groups sent to them;
each call of a reward or logprob stage takes a free worker (a reward rank,
or a logprob replica whose tp ranks all compute and whose first writes),
and the controller merges the groups that wait for one; the trainer's ranks all take part in
begin / finish / abort / export while each microbatch goes to one
data-parallel replica. Weights travel through the host bucket cache: the
trainer puts each bucket into the object store once per step (its export),
and every push or refresh hands the same object references to the
receivers, so the trainer is never asked for a bucket while it trains.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Sequence

from rldsl.runtime.control.handles import StageHandles


class HostBucketCache:
    """The newest exported version: one object reference per bucket."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.refs: list = []

    def holds(self, version: int) -> bool:
        return self.version == version


def ray_stage_handles(workers: dict[str, list], kinds: dict[str, str], receiver_stages: set[str],
                      bucket_bytes: int, train_stage: str, replicas: dict[str, list[list[int]]],
                      observers: list | None = None, tracer=None) -> StageHandles:
    """``workers``: stage name -> actor handles (one per rank; one per replica
    for generate stages); ``kinds``: stage name -> stage kind;
    ``receiver_stages``: the stages on sync edges; ``replicas``: for the
    trainer and each logprob stage, the rank indices of each data-parallel
    replica (the tp x pp ranks that must all see the same rows);
    ``observers``: weight receivers the push does not wait for (the
    evaluator: it must never hold up generation); ``tracer``: records each
    weight push as a span."""
    generator_stages = [name for name in workers if kinds[name] == "generate"]
    generators = [a for name in generator_stages for a in workers[name]]
    syncs_generator = [name in receiver_stages for name in generator_stages for _ in workers[name]]
    other_receivers = [a for name in sorted(receiver_stages) if kinds[name] != "generate" for a in workers[name]]
    free = {name: _FreeWorkers([[actor] for actor in actors]) for name, actors in workers.items()
            if kinds[name] == "reward"}
    free.update({name: _FreeWorkers([[workers[name][i] for i in ranks] for ranks in groups])
                 for name, groups in replicas.items() if kinds[name] == "logprob"})
    train_replicas = [[workers[train_stage][i] for i in ranks] for ranks in replicas[train_stage]]
    trainers = workers[train_stage]
    cache = HostBucketCache()

    async def generate(replica: int, prompts: Sequence, keys: Sequence[str], samples_per_prompt: int, seed: int):
        return await generators[replica].generate.remote(list(prompts), list(keys), samples_per_prompt, seed)

    async def reward(stage: str, keys: Sequence[str]):
        async with free[stage].borrow() as (worker,):
            return await worker.reward.remote(list(keys))

    async def logprob(stage: str, keys: Sequence[str]) -> None:
        async with free[stage].borrow() as replica:
            await asyncio.gather(*(a.logprob.remote(list(keys)) for a in replica))

    async def begin_train_step(step: int) -> None:
        await asyncio.gather(*(t.begin_train_step.remote(step) for t in trainers))

    async def train_microbatch(step: int, keys: Sequence[str], replica: int):
        results = await asyncio.gather(*(t.train_microbatch.remote(step, list(keys)) for t in train_replicas[replica]))
        return next((r for r in results if r), results[0])  # pipeline stages without the loss report nothing

    async def finish_train_step(step: int):
        results = await asyncio.gather(*(t.finish_train_step.remote(step) for t in trainers))
        return results[0]

    async def abort_train_step(step: int) -> None:
        await asyncio.gather(*(t.abort_train_step.remote(step) for t in trainers), return_exceptions=True)

    async def export_weights(version: int) -> None:
        # every rank takes part (gathering TP/PP shards is a collective); rank 0 returns the references
        refs = (await asyncio.gather(*(t.export_buckets.remote(bucket_bytes) for t in trainers)))[0]
        cache.version, cache.refs = version, refs

    async def push_weights(version: int, replicas_to_push: Sequence[int]) -> None:
        if not cache.holds(version):
            raise RuntimeError(f"push of weights version {version}, but the host bucket cache holds {cache.version}")
        targets = [generators[i] for i in replicas_to_push if syncs_generator[i]] + other_receivers
        span = tracer.span("weight push", version=version, receivers=len(targets)) if tracer else None
        with span or contextlib.nullcontext():
            refs = list(cache.refs)
            for observer in observers or ():  # not awaited; in order per caller, so its buckets arrive in sequence
                for index, ref in enumerate(refs):
                    observer.update_weights.remote(ref, version, index == len(refs) - 1)
            await asyncio.gather(*(target.receive_weights.remote(refs, version) for target in targets))

    async def generator_version() -> int:
        return await generators[0].version.remote()

    async def sleep_generators(indices: Sequence[int]) -> None:
        """The train phase: these replicas release the GPUs, an offloaded trainer takes them back."""
        await asyncio.gather(*(generators[i].sleep.remote() for i in indices))
        if indices:
            await asyncio.gather(*(t.wake.remote() for t in trainers))

    async def wake_generators(indices: Sequence[int], version: int) -> None:
        """The generation phase: the trainer offloads (if it does), the replicas
        wake and, if they missed versions, load the newest from the host cache."""
        if indices:
            await asyncio.gather(*(t.sleep.remote() for t in trainers))
        await asyncio.gather(*(generators[i].wake.remote() for i in indices))
        if cache.holds(version):
            await asyncio.gather(*(generators[i].refresh.remote(list(cache.refs), version)
                                   for i in indices if syncs_generator[i]))

    return StageHandles(generate, reward, logprob, begin_train_step, train_microbatch, finish_train_step,
                        abort_train_step, export_weights, push_weights, generator_version, sleep_generators,
                        wake_generators, generator_replicas=len(generators), train_replicas=len(train_replicas),
                        stage_slots={name: pool.size for name, pool in free.items()})


class _FreeWorkers:
    """The idle workers of one stage; a call borrows one and gives it back."""

    def __init__(self, workers: list[list]) -> None:
        self.size = len(workers)
        self._idle: asyncio.Queue = asyncio.Queue()
        for worker in workers:
            self._idle.put_nowait(worker)

    @contextlib.asynccontextmanager
    async def borrow(self):
        worker = await self._idle.get()
        try:
            yield worker
        finally:
            self._idle.put_nowait(worker)
