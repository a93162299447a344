"""In-process stage handles over the sim engines.

``SimStages`` runs a pool of sim engines on the controller's own event loop
and exposes them as the controller's ``StageHandles``, reading and writing
the data plane like real workers do, so tests and benchmarks drive a whole
pipeline in one process.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Sequence

from rldsl.runtime import protocols as p
from rldsl.runtime.control.handles import StageHandles
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.control.state import resolve
from rldsl.runtime.engines.sim.engines import SimGenerator, SimLogprob, SimRewardWorker, SimTrainer, SplitStepError
from rldsl.runtime.engines.sim.latency import Latency, Timed
from rldsl.runtime.protocols import MIB

TRAIN_FIELDS = (p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK, p.FIELD_BEHAVIOUR_LOGPROBS, p.FIELD_VERSION,
                p.FIELD_REWARD, p.FIELD_ADVANTAGE)


@dataclass(frozen=True)
class SimConfig:
    """Latencies are per call: one prompt group per generate / reward /
    logprob call, one group per microbatch, one push per bucket."""

    generate: Latency = Latency()
    reward: Latency = Latency()
    logprob: Latency = Latency()
    microbatch: Latency = Latency()
    finish: Latency = Latency()
    push_bucket: Latency = Latency()
    generators: int = 1  # generator engines; each holds one group at a time
    reward_workers: int = 1
    reward_fail_prob: float = 0.0  # per sample
    reward_call_fail_prob: float = 0.0  # the whole call raises
    generate_fail_prob: float = 0.0
    trainer_fail_prob: float = 0.0
    trainer_fail_on: tuple[tuple[str, int], ...] = ()
    weight_bytes: int = MIB
    logprob_fields: Mapping[str, str] = field(default_factory=dict)  # stage -> field; default ref_logprobs
    vocab_size: int = 64
    prompt_len: int = 8
    max_new_tokens: int = 16


class SimStages:
    """Sim engines in this process and the ``StageHandles`` that drive them.

    Generators and reward workers are pools: a call waits for an idle engine,
    so ``generators`` bounds generation concurrency like real workers do.
    ``microbatch_keys`` records (step, keys) for every microbatch."""

    def __init__(self, settings: RunSettings, dataplane: Any, config: SimConfig = SimConfig()) -> None:
        self.settings, self.dataplane, self.config = settings, dataplane, config
        seed, c = settings.seed * 7919, config
        self.generators = [
            SimGenerator(c.generate, c.vocab_size, c.prompt_len, c.max_new_tokens, c.generate_fail_prob, seed + i)
            for i in range(c.generators)
        ]
        self.reward_workers = [
            SimRewardWorker(c.reward, 0.5, c.reward_fail_prob, c.reward_call_fail_prob, seed + 1000 + i)
            for i in range(c.reward_workers)
        ]
        self.logprob_engine = SimLogprob(c.logprob, seed + 2000)
        self.trainer = SimTrainer(
            c.microbatch, c.finish, c.trainer_fail_on, c.trainer_fail_prob, c.weight_bytes, seed + 3000
        )
        self._push_timer = Timed(c.push_bucket, seed + 4000)
        self._pools: dict[str, asyncio.Queue] = {}
        self.microbatch_keys: list[tuple[int, tuple[str, ...]]] = []
        self._pushing = False
        self.handles = StageHandles(
            self.generate, self.reward, self.logprob, _as_async(self.trainer.begin_train_step), self.train_microbatch,
            self.finish_train_step, _as_async(self.trainer.abort_train_step), self.push_weights, self.generator_version,
        )

    async def generate(
        self, prompts: Sequence[p.Prompt], keys: Sequence[str], samples_per_prompt: int, seed: int
    ) -> int:
        requested_at = asyncio.get_running_loop().time()
        async with _borrow(self._pool("generators")) as generator:
            batch = await generator.generate_async(prompts, samples_per_prompt, seed, requested_at)
        await self._put(keys, batch)
        return int(batch[p.FIELD_VERSION][0])

    async def reward(self, stage: str, keys: Sequence[str]) -> list[float | None]:
        requested_at = asyncio.get_running_loop().time()
        async with _borrow(self._pool("rewards")) as worker:
            return await worker.score_async(len(keys), requested_at)

    async def logprob(self, stage: str, keys: Sequence[str]) -> None:
        batch = await self._get(keys, (p.FIELD_RESPONSE_MASK,))
        values = await self.logprob_engine.logprobs_async(batch)
        await self._put(keys, {self.config.logprob_fields.get(stage, p.FIELD_REF_LOGPROBS): values})

    async def train_microbatch(self, step: int, keys: Sequence[str]) -> dict[str, float]:
        self.microbatch_keys.append((step, tuple(keys)))
        batch = await self._get(keys, TRAIN_FIELDS)
        return await self.trainer.train_microbatch_async(step, batch)

    async def finish_train_step(self, step: int) -> p.StepResult:
        if self._pushing:
            raise SplitStepError(f"finish_train_step({step}) while a weight push reads the weights")
        return await self.trainer.finish_train_step_async(step)

    async def push_weights(self, version: int) -> None:
        buckets = list(self.trainer.weight_buckets(self.settings.sync_bucket_bytes))
        self._pushing = True
        try:
            for index, bucket in enumerate(buckets):
                await self._push_timer._hold(self._push_timer._draw())
                for generator in self.generators:
                    generator.update_weights(bucket, version, last=index == len(buckets) - 1)
        finally:
            self._pushing = False

    async def generator_version(self) -> int:
        return min(generator.version for generator in self.generators)

    def _pool(self, name: str) -> asyncio.Queue:
        if not self._pools:  # built lazily: the queues belong to the controller's loop
            for pool_name, engines in (("generators", self.generators), ("rewards", self.reward_workers)):
                self._pools[pool_name] = asyncio.Queue()
                for engine in engines:
                    self._pools[pool_name].put_nowait(engine)
        return self._pools[name]

    async def _put(self, keys: Sequence[str], fields: dict) -> None:
        await resolve(self.dataplane.put(list(keys), self.settings.pipeline, fields, None))

    async def _get(self, keys: Sequence[str], fields: Sequence[str]) -> dict:
        return await resolve(self.dataplane.get(list(keys), self.settings.pipeline, list(fields)))


def _as_async(call: Any) -> Any:
    async def called(*args: Any) -> Any:
        return call(*args)

    return called


@asynccontextmanager
async def _borrow(pool: asyncio.Queue) -> AsyncIterator[Any]:
    """Take an idle engine from the pool for one call, then give it back."""
    engine = await pool.get()
    try:
        yield engine
    finally:
        pool.put_nowait(engine)


def sim_stage_handles(settings: RunSettings, dataplane: Any, config: SimConfig = SimConfig()) -> StageHandles:
    """In-process ``StageHandles`` over fresh sim engines (see ``SimStages``
    to keep a hold of the engines)."""
    return SimStages(settings, dataplane, config).handles
