"""The state the controller's pumps share, and the rollout and sync pumps.

Everything runs on one asyncio loop, so the state needs no locks: a pump
reads and mutates it between awaits and calls ``changed.notify()``; every
waiting pump then wakes and re-checks its own condition.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from rldsl.runtime import ledger as outcomes
from rldsl.runtime.buffer import Group, GroupState, ReplayBuffer
from rldsl.runtime.dataplane import sample_key
from rldsl.runtime.ledger import Ledger
from rldsl.runtime.protocols import Prompt
from rldsl.runtime.sampler import DispatchPlan, StalenessSampler, TrainProgress
from rldsl.runtime.settings import RunSettings

if TYPE_CHECKING:
    from rldsl.runtime.controller import StageHandles


class Notifier:
    """Wakes every waiter on each state change; waiters re-check themselves."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class BusyMeter:
    """Wall time during which at least one call to a stage was running."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._active = 0
        self._since = 0.0
        self._busy = 0.0

    @contextmanager
    def track(self) -> Iterator[None]:
        if self._active == 0:
            self._since = self._clock()
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._busy += self._clock() - self._since

    def busy_seconds(self, now: float) -> float:
        return self._busy + (now - self._since if self._active else 0.0)


async def resolve(value: Any) -> Any:
    """Await ``value`` if it is awaitable: the data plane may be sync or async."""
    return await value if inspect.isawaitable(value) else value


class RunState:
    def __init__(self, settings: RunSettings, stages: StageHandles, dataplane: Any, clock: Callable[[], float]):
        self.settings = settings
        self.stages = stages
        self.dataplane = dataplane
        self.clock = clock
        self.buffer = ReplayBuffer(settings.buffer_capacity)
        self.sampler = StalenessSampler(settings)
        self.ledger = Ledger()
        self.changed = Notifier()
        self.trainer_version = 0
        self.generator_version = 0
        self.batch_index = 0  # the open step's index, aborted attempts reuse it
        self.consumed_in_step = 0
        self.finished_steps = 0
        self.groups_dispatched = 0
        self.generating = 0  # groups inside a generate call
        self.sync_pending = False  # the sync pump holds dispatch to drain generation
        self.pushing = False  # weights are being read from the trainer
        self.generators_asleep = False  # colocated: the trainer has the GPUs
        self.prompts_exhausted = False
        self.training_done = False
        self.stop_requested = False  # Ctrl-C: end the open step and stop cleanly
        self.pending_clear: list[str] = []  # dropped keys, cleared with the next step
        self.last_error: dict[str, str] = {}
        self.started_at = self.last_progress = clock()
        self._meters: dict[str, BusyMeter] = {}

    def progress(self) -> None:
        self.last_progress = self.clock()
        self.changed.notify()

    def meter(self, stage: str) -> BusyMeter:
        return self._meters.setdefault(stage, BusyMeter(self.clock))

    def busy_fractions(self) -> dict[str, float]:
        now = self.clock()
        elapsed = max(now - self.started_at, 1e-9)
        return {name: round(m.busy_seconds(now) / elapsed, 4) for name, m in sorted(self._meters.items())}

    def train_progress(self) -> TrainProgress:
        return TrainProgress(self.trainer_version, self.batch_index, self.consumed_in_step, self.finished_steps)

    def drop(self, group: Group, reason: str, error: BaseException | None = None, pump: str = "rollout") -> None:
        """Drop a whole group: its slot frees now, its keys go with the next clear."""
        self.ledger.dropped(group.keys, reason)
        self.buffer.release(group.group_id)
        self.pending_clear.extend(group.keys)
        if error is not None:
            self.last_error[pump] = f"{reason}: {error!r}"
        self.changed.notify()

    def take_pending_clear(self) -> list[str]:
        keys, self.pending_clear = self.pending_clear, []
        return keys

    async def put(self, keys: Sequence[str], fields: dict) -> None:
        await resolve(self.dataplane.put(list(keys), self.settings.pipeline, fields, None))

    async def clear(self, keys: Sequence[str]) -> None:
        if keys:
            await resolve(self.dataplane.clear(list(keys), self.settings.pipeline))


class RolloutPump:
    """Prompts -> generate -> reward stages -> logprob stages, group by group."""

    def __init__(self, state: RunState, prompts: Iterable[Prompt]) -> None:
        self.state = state
        self._prompts = iter(prompts)
        self.tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        state = self.state
        while not state.training_done:
            blocked, plan = self.blocked_reason()
            if blocked is not None:
                await state.changed.wait()
                continue
            prompt = next(self._prompts, None)
            if prompt is None:
                state.prompts_exhausted = True
                state.changed.notify()
                continue
            self._dispatch(prompt, plan)
            await asyncio.sleep(0)  # let the new group start before planning the next
        while self.tasks:  # drain: groups in flight finish their stages
            await asyncio.wait(set(self.tasks))

    def blocked_reason(self) -> tuple[str | None, DispatchPlan | None]:
        state, settings = self.state, self.state.settings
        if state.training_done:
            return "run finished", None
        if state.sync_pending:
            return f"paused while weights sync to version {state.trainer_version}", None
        if state.generators_asleep:
            return "colocated generators sleep while the trainer runs", None
        if state.prompts_exhausted:
            return "prompt stream exhausted", None
        if not state.buffer.has_room:
            return f"buffer full ({state.buffer.describe()})", None
        in_flight = state.buffer.count(GroupState.RESERVED)
        if in_flight >= settings.max_inflight:
            return f"in-flight limit ({in_flight}/{settings.max_inflight} groups dispatched, not yet ready)", None
        plan = state.sampler.plan_dispatch(
            state.buffer, state.train_progress(), state.generator_version, state.groups_dispatched
        )
        return plan.blocked, plan

    def describe(self) -> str:
        blocked, _ = self.blocked_reason()
        text = blocked or "dispatching"
        in_flight = self.state.buffer.count(GroupState.RESERVED)
        if in_flight:
            text += f"; {in_flight} groups in flight ({self.state.generating} generating)"
        if "rollout" in self.state.last_error:
            text += f"; last failure {self.state.last_error['rollout']}"
        return text

    def _dispatch(self, prompt: Prompt, plan: DispatchPlan) -> None:
        state, settings = self.state, self.state.settings
        keys = tuple(sample_key(settings.pipeline, prompt.index, i) for i in range(settings.samples_per_prompt))
        group = state.buffer.reserve(prompt.index, keys, plan.target_step, state.generator_version)
        state.ledger.register(keys)
        state.groups_dispatched += 1
        state.generating += 1  # counted now, so a weight push cannot slip in before the call
        task = asyncio.create_task(self._process(group, prompt))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _process(self, group: Group, prompt: Prompt) -> None:
        state = self.state
        try:
            version = await self._generate(group, prompt)
        except Exception as error:  # an engine failure drops the group, never the run
            state.drop(group, outcomes.GENERATION_FAILED, error)
            return
        rewards = await self._score(group)
        if rewards is None or not await self._logprobs(group):
            return
        state.buffer.commit(group.group_id, group.keys, rewards, version)
        state.progress()

    async def _generate(self, group: Group, prompt: Prompt) -> int:
        state, settings = self.state, self.state.settings
        seed = (settings.seed * 1_000_003 + prompt.index) % (1 << 31)
        try:
            with state.meter("generate").track():
                return int(await state.stages.generate([prompt], list(group.keys), settings.samples_per_prompt, seed))
        finally:
            state.generating -= 1
            state.changed.notify()

    async def _score(self, group: Group) -> tuple[float, ...] | None:
        """Sum the reward stages per sample; failed samples are dropped.
        Returns the survivors' rewards, or None when none survived."""
        state = self.state
        totals = dict.fromkeys(group.keys, 0.0)
        for stage in state.settings.reward_stages:
            alive = list(totals)
            rewards = await self._reward_stage(stage, alive)
            failed = [key for key, reward in zip(alive, rewards) if reward is None]
            if failed:
                state.ledger.dropped(failed, outcomes.REWARD_FAILED)
                state.pending_clear.extend(failed)
            for key, reward in zip(alive, rewards):
                if reward is None:
                    del totals[key]
                else:
                    totals[key] += reward
        group.keys = tuple(totals)
        if not totals:
            state.buffer.release(group.group_id)
            state.changed.notify()
            return None
        return tuple(totals.values())

    async def _reward_stage(self, stage: str, keys: list[str]) -> list[float | None]:
        """One reward per key, None where it failed; a raising stage fails all."""
        state = self.state
        try:
            with state.meter(f"reward:{stage}").track():
                results = list(await state.stages.reward(stage, keys))
            if len(results) != len(keys):
                raise ValueError(f"{len(results)} rewards for {len(keys)} samples")
            return [_finite_or_none(r) for r in results]
        except Exception as error:
            state.last_error["rollout"] = f"{outcomes.REWARD_FAILED} ({stage}): {error!r}"
            return [None] * len(keys)

    async def _logprobs(self, group: Group) -> bool:
        state = self.state
        for stage in state.settings.logprob_stages:
            try:
                with state.meter(f"logprob:{stage}").track():
                    await state.stages.logprob(stage, list(group.keys))
            except Exception as error:
                state.drop(group, outcomes.LOGPROB_FAILED, error)
                return False
        return True


def _finite_or_none(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class SyncPump:
    """After each finished step: drain generation, push weights, resume.

    Generators swap weights only between groups, so dispatch pauses while
    groups already mid-generation finish; reward and logprob stages, and the
    trainer, keep running. Steps that finish during a push coalesce into one
    push of the newest version."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.pushes = 0
        self.phase = "idle"

    async def run(self) -> None:
        state = self.state
        while True:
            if state.generator_version >= state.trainer_version:
                if state.training_done:
                    self.phase = "done"
                    return
                self.phase = "idle"
                await state.changed.wait()
                continue
            target = state.trainer_version
            state.sync_pending = True
            state.changed.notify()
            while state.generating > 0:
                self.phase = f"waiting for {state.generating} groups mid-generation before pushing version {target}"
                await state.changed.wait()
            self.phase = f"pushing weights version {target}"
            state.pushing = True
            with state.meter("sync").track():
                await state.stages.push_weights(target)
            state.generator_version = target
            state.sync_pending = state.pushing = False
            self.pushes += 1
            state.progress()
