"""StageHandles over Ray actors, built inside the controller actor.

Generator replicas are threaded actors that batch the groups sent to them;
each call of a reward or logprob stage takes a free worker (a reward rank,
or a logprob replica whose tp ranks all compute and whose first writes),
and the controller merges the groups that wait for one; the trainer's
ranks all take part in begin / finish / abort / export while each
microbatch goes to one data-parallel replica. Weights travel through the
host bucket cache: the trainer puts each bucket into the object store once
per step (its export), and every push or refresh hands the same object
references to the receivers, so the trainer is never asked for a bucket
while it trains. Every call goes through the supervisor (supervision.py):
a dead generator, reward or logprob actor is replaced, brought to the
cached weights, and the call made again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Sequence

from rldsl.runtime.control.errors import WorkerLost
from rldsl.runtime.control.handles import StageHandles
from rldsl.runtime.ray_lowering.supervision import ActorSpec, Supervisor
from rldsl.runtime.ray_lowering.weight_group import CollectiveSync

log = logging.getLogger(__name__)


class HostBucketCache:
    """The newest exported version: one object reference per bucket."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.refs: list = []

    def holds(self, version: int) -> bool:
        return self.version == version


def ray_stage_handles(supervisor: Supervisor, kinds: dict[str, str], receiver_stages: set[str],
                      bucket_bytes: int, train_stage: str, replicas: dict[str, list[list[int]]],
                      observers: list | None = None, tracer=None,
                      reward_calls: dict[str, int] | None = None, cache: HostBucketCache | None = None,
                      collective: CollectiveSync | None = None, export_overlaps: bool = False) -> StageHandles:
    """``supervisor``: every stage's actors by rank (one per replica for
    generate stages), replaced when they die; ``kinds``: stage name -> stage
    kind; ``receiver_stages``: the stages on sync edges; ``replicas``: for
    the trainer and each logprob stage, the rank indices of each
    data-parallel replica (the tp x pp ranks that must all see the same
    rows); ``observers``: weight receivers the push does not wait for (the
    evaluator: it must never hold up generation); ``tracer``: records each
    weight push as a span; ``reward_calls``: reward stage -> calls one of its
    workers serves at once (one per reward process); ``cache``: the host
    bucket cache, when the caller keeps it too; ``collective``: the
    pipeline's weight group, when its sync goes rank to rank
    (weight_group.py): an export is then the push itself;
    ``export_overlaps``: the trainer's export may run while the next step
    trains (a stream runs in the trainer actor's ``PUSH`` concurrency group,
    beside the step's calls)."""
    reward_calls = reward_calls or {}
    actors = supervisor.actors
    generators = [(name, rank) for name in actors if kinds[name] == "generate" for rank in range(len(actors[name]))]
    syncs_generator = [name in receiver_stages for name, _ in generators]
    other_receivers = [(name, rank) for name in sorted(receiver_stages) if kinds[name] != "generate"
                       for rank in range(len(actors[name]))]
    free = {name: _FreeWorkers([[rank] for rank in range(len(ranks)) for _ in range(reward_calls.get(name, 1))])
            for name, ranks in actors.items() if kinds[name] == "reward"}
    free.update({name: _FreeWorkers(groups) for name, groups in replicas.items() if kinds[name] == "logprob"})
    train_replicas = replicas[train_stage]
    trainer_ranks = range(len(actors[train_stage]))
    cache = cache if cache is not None else HostBucketCache()
    asleep: set[int] = set()  # generator replicas the controller has put to sleep

    def call(stage: str, rank: int, method: str, *args):
        return supervisor.call(stage, rank, method, *args)

    async def on_generator(replica: int, method: str, *args):
        try:
            return await call(*generators[replica], method, *args)
        except WorkerLost as lost:
            lost.replica = replica  # the controller stops using that replica
            raise

    async def on_generators(replicas: Sequence[int], method: str, *args) -> None:
        """Every replica's call runs to its end; then the first loss, if any, is raised."""
        results = await asyncio.gather(*(on_generator(i, method, *args) for i in replicas), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure

    def on_every_trainer(method: str, *args, **gather):
        return asyncio.gather(*(call(train_stage, r, method, *args) for r in trainer_ranks), **gather)

    async def generate(replica: int, prompts: Sequence, keys: Sequence[str], samples_per_prompt: int, seed: int):
        return await on_generator(replica, "generate", list(prompts), list(keys), samples_per_prompt, seed)

    async def reward(stage: str, keys: Sequence[str]):
        async with free[stage].borrow() as (rank,):
            return await call(stage, rank, "reward", list(keys))

    async def logprob(stage: str, keys: Sequence[str], version: int | None = None):
        async with free[stage].borrow() as ranks:
            reported = await asyncio.gather(*(call(stage, rank, "logprob", list(keys), version) for rank in ranks))
        return next((versions for versions in reported if versions), None)  # the scoring version, per key

    async def begin_train_step(step: int) -> None:
        await on_every_trainer("begin_train_step", step)

    async def train_microbatch(step: int, keys: Sequence[str], replica: int):
        results = await asyncio.gather(*(call(train_stage, r, "train_microbatch", step, list(keys))
                                         for r in train_replicas[replica]))
        return next((r for r in results if r), results[0])  # pipeline stages without the loss report nothing

    async def finish_train_step(step: int):
        return (await on_every_trainer("finish_train_step", step))[0]

    async def optimizer_step(step: int) -> dict:
        return (await on_every_trainer("optimizer_step", step))[0]

    async def abort_train_step(step: int) -> None:
        await on_every_trainer("abort_train_step", step, return_exceptions=True)

    async def export_weights(version: int) -> None:
        if collective is not None and collective.enabled:
            try:
                with tracer.span("weight push", version=version, transport="collective") if tracer \
                        else contextlib.nullcontext():
                    cache.version, cache.refs = version, await collective.push(
                        call, trainer_ranks, train_stage, bucket_bytes, version, to_store=bool(observers))
                return
            except WorkerLost as lost:
                if lost.stage == train_stage:
                    raise
                reason = str(lost)
            except Exception as error:  # noqa: BLE001 - any broken push falls back the same way
                reason = f"{type(error).__name__}: {error}"
            log.warning("the collective push of weights version %d failed (%s); this version goes through the "
                        "object store and the weight group forms anew at the next export", version, reason)
        # every rank takes part (gathering TP/PP shards is a collective); rank 0 returns the references
        refs = (await on_every_trainer("export_buckets", bucket_bytes))[0]
        cache.version, cache.refs = version, refs

    async def push_weights(version: int, replicas_to_push: Sequence[int]) -> None:
        if not cache.holds(version):
            raise RuntimeError(f"push of weights version {version}, but the host bucket cache holds {cache.version}")
        if collective is not None and collective.enabled and collective.delivered == version:
            # the export itself delivered this version to every member: only the evaluator is left
            feed_observers(version, list(cache.refs))
            return
        pushed = [i for i in replicas_to_push if syncs_generator[i]]
        span = tracer.span("weight push", version=version, receivers=len(pushed) + len(other_receivers)) \
            if tracer else None
        with span or contextlib.nullcontext():
            refs = list(cache.refs)
            feed_observers(version, refs)
            await asyncio.gather(on_generators(pushed, "receive_weights", refs, version),
                                 *(call(*target, "receive_weights", refs, version) for target in other_receivers))

    def feed_observers(version: int, refs: list) -> None:
        for observer in observers or ():  # not awaited; in order per caller, so its buckets arrive in sequence
            for index, ref in enumerate(refs):
                observer.update_weights.remote(ref, version, index == len(refs) - 1)

    async def generator_version() -> int:
        return await call(*generators[0], "version")

    async def sleep_generators(indices: Sequence[int]) -> None:
        """These replicas release their GPU memory (the call returns once they have)."""
        asleep.update(indices)
        await on_generators(indices, "sleep")

    async def wake_generators(indices: Sequence[int], version: int) -> None:
        """These replicas take their GPU memory back and, if they missed
        versions, load the newest from the host cache before they serve."""
        asleep.difference_update(indices)
        await on_generators(indices, "wake")
        if cache.holds(version):
            await on_generators([i for i in indices if syncs_generator[i]], "refresh", list(cache.refs), version)

    async def sleep_trainer() -> None:
        await on_every_trainer("sleep")

    async def wake_trainer() -> None:
        await on_every_trainer("wake")

    async def bring_up_to_date(spec: ActorSpec, actor) -> None:
        """A replacement actor: the newest exported weights if it receives
        them, and asleep if its replica is."""
        if collective is not None and collective.enabled and (spec.stage, spec.rank) in collective.members:
            collective.replaced((spec.stage, spec.rank))
            if cache.version is not None and not cache.refs:
                raise RuntimeError(
                    f"the collective weight transport keeps no host copy of weights version {cache.version} to bring "
                    "a replacement up to date; set `transport = object_store` on the sync to replace dead generators")
        if cache.version is not None and spec.stage in receiver_stages:
            method = "refresh" if spec.kind == "generate" else "receive_weights"
            await supervisor.remote(spec.stage, spec.rank, method, list(cache.refs), cache.version, actor=actor)
        if spec.kind == "generate" and generators.index((spec.stage, spec.rank)) in asleep:
            await supervisor.remote(spec.stage, spec.rank, "sleep", actor=actor)

    async def decoded_tokens() -> list[int]:
        """Each replica's tokens decoded so far (-1: no answer); polled by the watchdog, never replaces an actor."""
        async def count(generator) -> int:
            return int(await supervisor.remote(*generator, "decoded_tokens"))

        counts = await asyncio.gather(*(count(g) for g in generators), return_exceptions=True)
        return [-1 if isinstance(n, BaseException) else n for n in counts]

    async def abort_generation() -> None:
        await asyncio.gather(*(call(*g, "abort") for g in generators), return_exceptions=True)

    supervisor.on_replaced = bring_up_to_date
    return StageHandles(generate, reward, logprob, begin_train_step, train_microbatch, finish_train_step,
                        abort_train_step, export_weights, push_weights, generator_version, sleep_generators,
                        wake_generators, sleep_trainer, wake_trainer, generator_replicas=len(generators),
                        train_replicas=len(train_replicas),
                        stage_slots={name: pool.size for name, pool in free.items()}, optimizer_step=optimizer_step,
                        decoded_tokens=decoded_tokens, abort_generation=abort_generation,
                        export_overlaps=export_overlaps)


def reward_calls_per_worker(stage) -> int:
    """Calls a reward worker serves at once: one per reward process it owns,
    and one more for each sample its processes may hand off (reward_pool.py):
    a call waiting out a hung sample's deadline does not hold back the calls
    behind it, whose chunks queue for the pool's processes meanwhile."""
    from rldsl.runtime.reward_pool import HANDED_OFF_PER_PROCESS

    processes = int(stage.settings.get("processes", 1))
    return processes * (1 + HANDED_OFF_PER_PROCESS)


class _FreeWorkers:
    """The idle workers of one stage (each a list of rank indices); a call
    borrows one and gives it back."""

    def __init__(self, workers: list[list[int]]) -> None:
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
