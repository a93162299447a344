"""The ``sim`` engine family: the engine protocols without models.

Engines draw seeded latencies (``Latency``) and return data of the real
shapes, so the controller, the data plane and the Ray layer run end to end
without a model. Sleeping: the protocol methods block with ``time.sleep``, as
a real engine inside a Ray actor does; their ``*_async`` twins await
``asyncio.sleep`` so that ``SimStages`` can simulate many concurrent workers
on the controller's own event loop.

``SimTrainer`` is a dry-run trainer that enforces the split-step protocol:
``begin`` while a step is open raises, a microbatch or finish with no open
step or for another step raises, ``abort`` is idempotent; it records calls.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Collection, Iterator, Mapping, Sequence

import torch

from rldsl.runtime import protocols as p
from rldsl.runtime.controller import StageHandles
from rldsl.runtime.pumps import resolve
from rldsl.runtime.settings import MIB, RunSettings


@dataclass(frozen=True)
class Latency:
    """Seconds per call: constant, uniform or lognormal, plus an optional
    long tail (with probability ``tail_prob`` the draw is multiplied by
    ``tail_mult``)."""

    kind: str = "constant"  # "constant" | "uniform" | "lognormal"
    seconds: float = 0.0  # the constant, the uniform low end, or the lognormal median
    high: float = 0.0  # uniform high end
    sigma: float = 0.0  # lognormal spread
    tail_prob: float = 0.0
    tail_mult: float = 1.0

    @classmethod
    def constant(cls, seconds: float, tail_prob: float = 0.0, tail_mult: float = 1.0) -> Latency:
        return cls("constant", seconds, tail_prob=tail_prob, tail_mult=tail_mult)

    @classmethod
    def uniform(cls, low: float, high: float, tail_prob: float = 0.0, tail_mult: float = 1.0) -> Latency:
        return cls("uniform", low, high=high, tail_prob=tail_prob, tail_mult=tail_mult)

    @classmethod
    def jittered(cls, seconds: float, jitter: float = 0.0, tail_prob: float = 0.0, tail_mult: float = 1.0) -> Latency:
        """``seconds`` give or take the fraction ``jitter``: the language's
        ``sim(latency = 50ms, jitter = 20%, tail = 5%, tail_factor = 8)``."""
        return cls.uniform(seconds * (1 - jitter), seconds * (1 + jitter), tail_prob, tail_mult)

    @classmethod
    def lognormal(cls, median: float, sigma: float = 0.5, tail_prob: float = 0.0, tail_mult: float = 1.0) -> Latency:
        return cls("lognormal", median, sigma=sigma, tail_prob=tail_prob, tail_mult=tail_mult)

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "uniform", "lognormal"):
            raise ValueError(f"unknown latency kind {self.kind!r}")
        if self.seconds < 0 or self.high < 0 or not 0 <= self.tail_prob <= 1 or self.tail_mult < 0:
            raise ValueError(f"invalid latency {self}")

    def sample(self, rng: random.Random) -> float:
        if self.kind == "uniform":
            value = rng.uniform(self.seconds, max(self.high, self.seconds))
        elif self.kind == "lognormal":
            value = self.seconds * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        else:
            value = self.seconds
        if self.tail_prob and rng.random() < self.tail_prob:
            value *= self.tail_mult
        return value


class SimFailure(RuntimeError):
    """An injected engine failure."""


class SplitStepError(RuntimeError):
    """A split-step protocol violation caught by the dry-run trainer."""


class _Timed:
    def __init__(self, latency: Latency, seed: int) -> None:
        self.latency = latency
        self._rng = random.Random(seed)
        self._busy_until = 0.0

    def _draw(self) -> float:
        return self.latency.sample(self._rng)

    async def _hold(self, seconds: float, requested_at: float | None = None) -> None:
        """Sleep so the call ends ``seconds`` after it could start: when it
        was requested or when this engine's previous call ended, whichever is
        later. Back-to-back calls thus keep an exact timeline instead of
        adding up the event loop's wake-up jitter (1-3 ms per sleep here)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = min(now, max(now if requested_at is None else requested_at, self._busy_until))
        self._busy_until = start + seconds
        await asyncio.sleep(max(0.0, self._busy_until - now))

    def _chance(self, probability: float) -> bool:
        return probability > 0 and self._rng.random() < probability


class SimGenerator(_Timed):
    """``GenerationEngine``: random tokens of realistic shapes."""

    def __init__(self, latency: Latency = Latency(), vocab_size: int = 64, prompt_len: int = 8,
                 max_new_tokens: int = 16, fail_prob: float = 0.0, seed: int = 0) -> None:
        super().__init__(latency, seed)
        self.vocab_size, self.prompt_len, self.max_new_tokens = vocab_size, prompt_len, max_new_tokens
        self.fail_prob = fail_prob
        self.version = 0
        self.generating = False
        self.asleep = False
        self._incoming: int | None = None  # version of a push in progress

    def generate(self, prompts: list[p.Prompt], samples_per_prompt: int, seed: int) -> p.Batch:
        with self._generating():
            time.sleep(self._draw())
            return self._batch(prompts, samples_per_prompt, seed)

    async def generate_async(
        self, prompts: Sequence[p.Prompt], samples_per_prompt: int, seed: int, requested_at: float | None = None
    ) -> p.Batch:
        with self._generating():
            await self._hold(self._draw(), requested_at)
            return self._batch(prompts, samples_per_prompt, seed)

    def update_weights(self, bucket: Mapping[str, Any], version: int, last: bool) -> None:
        if self.generating:
            raise SplitStepError(f"weights version {version} pushed while a group is mid-generation")
        self._incoming = version
        if last:
            self.version, self._incoming = version, None

    def sleep(self) -> None:
        self.asleep = True

    def wake(self) -> None:
        self.asleep = False

    @contextmanager
    def _generating(self) -> Iterator[None]:
        if self._incoming is not None:
            raise SplitStepError("generate while a weight push is half done (mixed weights)")
        if self._chance(self.fail_prob):
            raise SimFailure("injected generation failure")
        self.generating = True
        try:
            yield
        finally:
            self.generating = False

    def _batch(self, prompts: Sequence[p.Prompt], samples_per_prompt: int, seed: int) -> p.Batch:
        rows = len(prompts) * samples_per_prompt
        rng = torch.Generator().manual_seed(seed)
        prompt_lens = torch.randint(1, self.prompt_len + 1, (len(prompts),), generator=rng)
        prompt_lens = prompt_lens.repeat_interleave(samples_per_prompt)  # a group shares its prompt
        response_lens = torch.randint(1, self.max_new_tokens + 1, (rows,), generator=rng)
        columns_p = torch.arange(self.prompt_len)
        prompt_mask = (columns_p >= self.prompt_len - prompt_lens[:, None]).long()  # left-padded
        response_mask = (torch.arange(self.max_new_tokens) < response_lens[:, None]).long()  # right-padded
        return {
            p.FIELD_PROMPT_IDS: torch.randint(1, self.vocab_size, (rows, self.prompt_len), generator=rng) * prompt_mask,
            p.FIELD_PROMPT_MASK: prompt_mask,
            p.FIELD_RESPONSE_IDS: torch.randint(1, self.vocab_size, (rows, self.max_new_tokens), generator=rng)
            * response_mask,
            p.FIELD_RESPONSE_MASK: response_mask,
            p.FIELD_BEHAVIOUR_LOGPROBS: _fake_logprobs(response_mask, rng),
            p.FIELD_VERSION: torch.full((rows,), self.version, dtype=torch.int64),
        }


class SimRewardWorker(_Timed):
    """Scores a group in one call: 1.0 with ``success_prob``, else 0.0; a
    sample fails (None) with ``fail_prob``; the call raises with ``call_fail_prob``."""

    def __init__(self, latency: Latency = Latency(), success_prob: float = 0.5, fail_prob: float = 0.0,
                 call_fail_prob: float = 0.0, seed: int = 0) -> None:
        super().__init__(latency, seed)
        self.success_prob, self.fail_prob, self.call_fail_prob = success_prob, fail_prob, call_fail_prob

    async def score_async(self, count: int, requested_at: float | None = None) -> list[float | None]:
        await self._hold(self._draw(), requested_at)
        if self._chance(self.call_fail_prob):
            raise SimFailure("injected reward worker failure")
        return [None if self._chance(self.fail_prob) else float(self._chance(self.success_prob)) for _ in range(count)]


class SimLogprob(_Timed):
    """``LogprobEngine``: random log-probabilities, 0 off the response mask."""

    def logprobs(self, batch: p.Batch) -> torch.Tensor:
        time.sleep(self._draw())
        return self._values(batch)

    async def logprobs_async(self, batch: p.Batch) -> torch.Tensor:
        await self._hold(self._draw())
        return self._values(batch)

    def _values(self, batch: p.Batch) -> torch.Tensor:
        return _fake_logprobs(batch[p.FIELD_RESPONSE_MASK], torch.Generator().manual_seed(self._rng.getrandbits(31)))


class SimTrainer:
    """``Trainer``: a dry-run split-step trainer.

    ``fail_on`` holds (call, step) pairs that raise ``SimFailure`` once each;
    ``fail_prob`` makes any microbatch or finish raise at random. ``calls``
    records (call, step, rows) in order."""

    def __init__(self, microbatch_latency: Latency = Latency(), finish_latency: Latency = Latency(),
                 fail_on: Collection[tuple[str, int]] = (), fail_prob: float = 0.0, weight_bytes: int = MIB,
                 seed: int = 0) -> None:
        self._microbatch = _Timed(microbatch_latency, seed)
        self._finish = _Timed(finish_latency, seed + 1)
        self._fail_on = set(fail_on)
        self.fail_prob = fail_prob
        self.weight_bytes = weight_bytes
        self.version = 0
        self.open_step: int | None = None
        self.calls: list[tuple[str, int, int]] = []
        self._rows_in_step = 0
        self._weights: torch.Tensor | None = None

    def begin_train_step(self, step: int) -> None:
        self.calls.append(("begin_train_step", step, 0))
        if self.open_step is not None:
            raise SplitStepError(f"begin_train_step({step}) while step {self.open_step} is open")
        self.open_step, self._rows_in_step = step, 0

    def train_microbatch(self, step: int, batch: p.Batch) -> dict[str, float]:
        time.sleep(self._before_microbatch(step, batch))
        return self._after_microbatch(batch)

    async def train_microbatch_async(self, step: int, batch: p.Batch) -> dict[str, float]:
        await self._microbatch._hold(self._before_microbatch(step, batch))
        return self._after_microbatch(batch)

    def finish_train_step(self, step: int) -> p.StepResult:
        time.sleep(self._before_finish(step))
        return self._after_finish()

    async def finish_train_step_async(self, step: int) -> p.StepResult:
        await self._finish._hold(self._before_finish(step))
        return self._after_finish()

    def abort_train_step(self, step: int) -> None:
        self.calls.append(("abort_train_step", step, 0))
        self.open_step, self._rows_in_step = None, 0

    def weight_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """Views of ``weight_bytes`` of fake float32 parameters, bucketed."""
        if self._weights is None:
            self._weights = torch.zeros(max(1, self.weight_bytes // 4))  # allocated once: pushes stay cheap
        per_bucket = max(1, bucket_bytes // 4)
        for index, start in enumerate(range(0, len(self._weights), per_bucket)):
            yield {f"layer{index}.weight": self._weights[start : start + per_bucket]}

    def _require_open(self, call: str, step: int) -> None:
        if self.open_step is None:
            raise SplitStepError(f"{call}({step}) with no open step")
        if self.open_step != step:
            raise SplitStepError(f"{call}({step}) but the open step is {self.open_step}")

    def _maybe_fail(self, call: str, step: int) -> None:
        if (call, step) in self._fail_on:
            self._fail_on.discard((call, step))
            raise SimFailure(f"injected {call} failure at step {step}")
        if self._microbatch._chance(self.fail_prob):
            raise SimFailure(f"injected random {call} failure at step {step}")

    def _before_microbatch(self, step: int, batch: p.Batch) -> float:
        self._require_open("train_microbatch", step)
        rows = len(batch[p.FIELD_RESPONSE_MASK])
        if p.FIELD_ADVANTAGE not in batch:
            raise SplitStepError(f"train_microbatch({step}) without the {p.FIELD_ADVANTAGE} field")
        if p.FIELD_VERSION in batch and int(max(batch[p.FIELD_VERSION])) > self.version:
            raise SplitStepError(f"train_microbatch({step}) on samples newer than the trainer's weights")
        self.calls.append(("train_microbatch", step, rows))
        self._maybe_fail("train_microbatch", step)
        return self._microbatch._draw()

    def _after_microbatch(self, batch: p.Batch) -> dict[str, float]:
        rows = len(batch[p.FIELD_RESPONSE_MASK])
        self._rows_in_step += rows
        return {"rows": float(rows), "tokens": float(batch[p.FIELD_RESPONSE_MASK].sum())}

    def _before_finish(self, step: int) -> float:
        self._require_open("finish_train_step", step)
        self.calls.append(("finish_train_step", step, self._rows_in_step))
        self._maybe_fail("finish_train_step", step)
        return self._finish._draw()

    def _after_finish(self) -> p.StepResult:
        self.version += 1
        rows, self.open_step, self._rows_in_step = self._rows_in_step, None, 0
        return p.StepResult(self.version, {"rows": float(rows)})


def _fake_logprobs(response_mask: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    values = -3.0 * torch.rand(response_mask.shape, generator=rng)
    return values * response_mask


# -- in-process stage handles -------------------------------------------------

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
        self._push_timer = _Timed(c.push_bucket, seed + 4000)
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
