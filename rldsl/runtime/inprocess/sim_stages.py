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
from rldsl.runtime.engines.schedule import LRSchedule
from rldsl.runtime.engines.sim.engines import SimGenerator, SimLogprob, SimRewardWorker, SimTrainer, SplitStepError
from rldsl.runtime.engines.sim.latency import Latency, Timed
from rldsl.runtime.protocols import MIB

TRAIN_FIELDS = (p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK, p.FIELD_BEHAVIOUR_LOGPROBS, p.FIELD_VERSION,
                p.FIELD_REWARD, p.FIELD_ADVANTAGE)


@dataclass(frozen=True)
class SimConfig:
    """Latencies are per call: one batch of prompt groups per generate call of
    a replica, one prompt group per reward / logprob call, one group per
    microbatch, one push per bucket."""

    generate: Latency = Latency()
    reward: Latency = Latency()
    logprob: Latency = Latency()
    microbatch: Latency = Latency()
    finish: Latency = Latency()
    push_bucket: Latency = Latency()
    generators: int = 1  # generator replicas; each decodes the groups queued on it in one batch
    generate_per_group: float | None = None  # seconds a batch takes per group beyond the first; None: 10% of generate
    train_replicas: int = 1  # data-parallel trainer replicas
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
    lr: float = 0.0  # the trainers report the LR their schedule gives each optimizer step
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)


class SimStages:
    """Sim engines in this process and the ``StageHandles`` that drive them.

    Each generator replica batches the groups queued on it (``SimReplica``);
    reward workers are a pool. The data-parallel trainer replicas are one
    ``SimTrainer`` each. The invariants real engines rely on are checked as
    the run goes: a trainer replica never runs two microbatches at once, no
    trainer call runs while a replica on the trainer's GPUs is awake, and no
    replica swaps weights mid-batch. ``microbatch_keys`` records
    (step, keys, replica) for every microbatch."""

    def __init__(self, settings: RunSettings, dataplane: Any, config: SimConfig = SimConfig(),
                 board: GpuBoard | None = None) -> None:
        self.settings, self.dataplane, self.config = settings, dataplane, config
        self.board = board or GpuBoard()
        seed, c = settings.seed * 7919, config
        self.generators = [
            SimGenerator(c.generate, c.vocab_size, c.prompt_len, c.max_new_tokens, c.generate_fail_prob, seed + i,
                         per_group=c.generate_per_group)
            for i in range(c.generators)
        ]
        self.replicas = [SimReplica(engine) for engine in self.generators]
        self.reward_workers = [
            SimRewardWorker(c.reward, 0.5, c.reward_fail_prob, c.reward_call_fail_prob, seed + 1000 + i)
            for i in range(c.reward_workers)
        ]
        self.logprob_engine = SimLogprob(c.logprob, seed + 2000)
        self.trainers = [
            SimTrainer(c.microbatch, c.finish, c.trainer_fail_on, c.trainer_fail_prob, c.weight_bytes, seed + 3000 + r,
                       lr=c.lr, lr_schedule=c.lr_schedule)
            for r in range(c.train_replicas)
        ]
        self.trainer = self.trainers[0]
        self._push_timer = Timed(c.push_bucket, seed + 4000)
        self._pools: dict[str, asyncio.Queue] = {}
        self._microbatch_running = [False] * c.train_replicas
        self._host_cache: tuple[int, list[dict]] | None = None
        self.microbatch_keys: list[tuple[int, tuple[str, ...], int]] = []
        self.handles = StageHandles(
            self.generate, self.reward, self.logprob, self.begin_train_step, self.train_microbatch,
            self.finish_train_step, self.abort_train_step, self.export_weights, self.push_weights,
            self.generator_version, self.sleep_generators, self.wake_generators, self.sleep_trainer,
            self.wake_trainer, generator_replicas=len(self.replicas), train_replicas=len(self.trainers),
            optimizer_step=self.optimizer_step,
        )
        self.trainer_resident = not settings.trainer_lease  # a leased trainer starts offloaded
        for index, replica in enumerate(self.replicas):
            if settings.replica_lease(index):  # as do replicas on GPUs shared with other pipelines
                replica.engine.sleep()

    async def generate(
        self, replica: int, prompts: Sequence[p.Prompt], keys: Sequence[str], samples_per_prompt: int, seed: int
    ) -> p.Generated:
        batch = await self.replicas[replica].submit(list(prompts), samples_per_prompt, seed)
        await self._put(keys, batch)
        return p.Generated(int(batch[p.FIELD_VERSION][0]), int(batch[p.FIELD_RESPONSE_MASK].sum()),
                           sample_tokens=p.sample_token_counts(batch))

    async def reward(self, stage: str, keys: Sequence[str]) -> list[float | None]:
        requested_at = asyncio.get_running_loop().time()
        async with _borrow(self._pool("rewards")) as worker:
            return await worker.score_async(len(keys), requested_at)

    async def logprob(self, stage: str, keys: Sequence[str], version: int | None = None) -> None:
        batch = await self._get(keys, (p.FIELD_RESPONSE_MASK,))
        values = await self.logprob_engine.logprobs_async(batch)
        await self._put(keys, {self.config.logprob_fields.get(stage, p.FIELD_REF_LOGPROBS): values})

    async def begin_train_step(self, step: int) -> None:
        self._require_trainer_turn("begin_train_step")
        for trainer in self.trainers:
            trainer.begin_train_step(step)

    async def train_microbatch(self, step: int, keys: Sequence[str], replica: int = 0) -> dict[str, float]:
        self._require_trainer_turn("train_microbatch")
        if self._microbatch_running[replica]:
            raise SplitStepError(f"trainer replica {replica} got a microbatch while one is running")
        self._microbatch_running[replica] = True
        try:
            self.microbatch_keys.append((step, tuple(keys), replica))
            batch = await self._get(keys, TRAIN_FIELDS)
            return await self.trainers[replica].train_microbatch_async(step, batch)
        finally:
            self._microbatch_running[replica] = False

    async def optimizer_step(self, step: int) -> dict[str, float]:
        """A mini-batch boundary: every replica steps its optimizer; the step stays open."""
        self._require_trainer_turn("optimizer_step")
        results = await asyncio.gather(*(t.optimizer_step_async(step) for t in self.trainers))
        return results[0]

    async def finish_train_step(self, step: int) -> p.StepResult:
        self._require_trainer_turn("finish_train_step")
        results = await asyncio.gather(*(t.finish_train_step_async(step) for t in self.trainers))
        return results[0]

    async def abort_train_step(self, step: int) -> None:
        for trainer in self.trainers:
            trainer.abort_train_step(step)

    async def export_weights(self, version: int) -> None:
        self._require_trainer_turn("export_weights")
        buckets = list(self.trainer.weight_buckets(self.settings.sync_bucket_bytes))
        self._host_cache = (version, buckets)

    async def push_weights(self, version: int, replicas: Sequence[int]) -> None:
        cached, buckets = self._host_cache or (version, [])
        if cached != version:
            raise SplitStepError(f"push of version {version} but the host cache holds {cached}")
        for _ in buckets:
            await self._push_timer._hold(self._push_timer._draw())
        for index in replicas:
            self.replicas[index].stage(buckets, version)

    async def generator_version(self) -> int:
        return min(generator.version for generator in self.generators)

    async def sleep_generators(self, replicas: Sequence[int]) -> None:
        for index in replicas:
            self.replicas[index].sleep()
            self.board.vacate(self.settings.replica_lease(index), self._name(f"rollout[{index}]"))

    async def wake_generators(self, replicas: Sequence[int], version: int) -> None:
        for index in replicas:
            replica = self.replicas[index]
            self.board.occupy(self.settings.replica_lease(index), self._name(f"rollout[{index}]"))
            replica.wake()
            if self._host_cache and replica.engine.version < version:
                replica.refresh(*self._host_cache[::-1])

    def _require_trainer_turn(self, call: str) -> None:
        """A trainer call runs only while the replicas on its GPUs sleep and it is resident."""
        awake = [i for i in self.settings.sleeping_replicas if i < len(self.replicas) and not self.generators[i].asleep]
        if awake:
            raise SplitStepError(f"{call} while generator replicas {awake} on the trainer's GPUs are awake")
        if not self.trainer_resident:
            raise SplitStepError(f"{call} while the trainer is offloaded (it holds no GPU lease)")

    async def sleep_trainer(self) -> None:
        self.trainer_resident = False
        self.board.vacate(self.settings.trainer_lease, self._name("trainer"))

    async def wake_trainer(self) -> None:
        self.board.occupy(self.settings.trainer_lease, self._name("trainer"))
        self.trainer_resident = True

    def _name(self, holder: str) -> str:
        return f"{self.settings.pipeline}/{holder}"

    def _pool(self, name: str) -> asyncio.Queue:
        if not self._pools:  # built lazily: the queues belong to the controller's loop
            self._pools["rewards"] = asyncio.Queue()
            for engine in self.reward_workers:
                self._pools["rewards"].put_nowait(engine)
        return self._pools[name]

    async def _put(self, keys: Sequence[str], fields: dict) -> None:
        await resolve(self.dataplane.put(list(keys), self.settings.pipeline, fields, None))

    async def _get(self, keys: Sequence[str], fields: Sequence[str]) -> dict:
        return await resolve(self.dataplane.get(list(keys), self.settings.pipeline, list(fields)))


class SimReplica:
    """One sim generator replica: the groups queued on it go into one batch
    (one ``generate_groups_async`` call); groups arriving meanwhile wait for
    the next. A staged version is swapped in between two batches."""

    def __init__(self, engine: SimGenerator) -> None:
        self.engine = engine
        self._queue: list[tuple[tuple, asyncio.Future, float]] = []  # request, its answer, when it came
        self._kick: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._staged: tuple[list[dict], int] | None = None
        self._decoding = False
        self.batches = 0
        self.max_groups = 0

    async def submit(self, prompts: list[p.Prompt], samples_per_prompt: int, seed: int) -> p.Batch:
        if self.engine.asleep:
            raise SplitStepError("generate on a sleeping replica")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append(((prompts, samples_per_prompt, seed), future, loop.time()))
        self._ensure_loop().set()
        return await future

    def stage(self, buckets: list[dict], version: int) -> None:
        self._staged = (buckets, version)
        self._swap()  # at once when idle, else by the batch loop when the batch ends

    def refresh(self, buckets: list[dict], version: int) -> None:
        self._staged = (buckets, version)
        self._swap()

    def sleep(self) -> None:
        if self._queue or self._decoding:
            raise SplitStepError("sleep while the replica has groups in flight")
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def _ensure_loop(self) -> asyncio.Event:
        if self._loop_task is None:
            self._kick = asyncio.Event()
            self._loop_task = asyncio.create_task(self._serve())
        return self._kick

    async def _serve(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            while self._queue:
                self._swap()  # between batches: never mid-batch
                taken, self._queue = self._queue, []
                self.batches += 1
                self.max_groups = max(self.max_groups, len(taken))
                self._decoding = True
                try:
                    # timed from the first request's arrival: an exact timeline, free of the loop's wake-up jitter
                    batches = await self.engine.generate_groups_async([request for request, _, _ in taken],
                                                                      min(at for _, _, at in taken))
                except Exception as error:
                    self._decoding = False
                    for _, future, _ in taken:
                        if not future.done():
                            future.set_exception(error)
                    continue
                self._decoding = False
                for (_, future, _), batch in zip(taken, batches):
                    if future.done():
                        continue
                    if isinstance(batch, Exception):  # that group's injected failure
                        future.set_exception(batch)
                    else:
                        future.set_result(batch)
            self._swap()

    def _swap(self) -> None:
        if self._staged is None or self._decoding:
            return
        buckets, version = self._staged
        self._staged = None
        for index, bucket in enumerate(buckets):
            self.engine.update_weights(bucket, version, last=index == len(buckets) - 1)
        if not buckets:
            self.engine.version = version


class GpuBoard:
    """Which GPU-resident phase is on each shared GPU now. Pipelines that
    share GPUs share one board; a phase that wakes onto a GPU another holds
    raises, so a run that finishes never had two residents at once."""

    def __init__(self) -> None:
        self.resident: dict[str, str] = {}
        self.moves = 0  # phases put on a GPU

    def occupy(self, gpus: Sequence[str], who: str) -> None:
        for gpu in gpus:
            other = self.resident.get(gpu)
            if other not in (None, who):
                raise SplitStepError(f"{who} woke onto GPU {gpu} while {other} is resident there")
        for gpu in gpus:
            self.resident[gpu] = who
        self.moves += bool(gpus)

    def vacate(self, gpus: Sequence[str], who: str) -> None:
        for gpu in gpus:
            if self.resident.get(gpu) == who:
                del self.resident[gpu]


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
