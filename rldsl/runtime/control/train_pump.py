"""The train pump: the split-step trainer fed one ready group at a time."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rldsl.runtime.control import ledger as outcomes
from rldsl.runtime.control.advantages import group_advantages
from rldsl.runtime.control.buffer import Group, GroupState
from rldsl.runtime.control.errors import StepFailed, StopRequested, TrainCallFailed
from rldsl.runtime.control.state import RunState, resolve
from rldsl.runtime.protocols import FIELD_ADVANTAGE, FIELD_REWARD, StepResult

StepCallback = Callable[[dict], None]


@dataclass
class StepBuild:
    batch_index: int
    version: int  # trainer version the step trains at
    started_at: float
    groups: list[Group] = field(default_factory=list)
    begun: bool = False


class TrainPump:
    """Builds each step from ready groups: lazy begin, one microbatch per group
    as it arrives, one finish and one data-plane clear; abort on failure."""

    def __init__(self, state: RunState, on_step: StepCallback | None) -> None:
        self.state = state
        self.on_step = on_step
        self.step: StepBuild | None = None
        self.activity: str | None = None  # what the pump awaits besides groups, for the watchdog
        self.aborted_steps = 0
        self._aborted_in_row = 0

    async def run(self) -> None:
        state = self.state
        try:
            while state.finished_steps < state.settings.steps and not state.stop_requested:
                step = self.step = StepBuild(state.batch_index, state.trainer_version, state.clock())
                try:
                    await self._fill(step)
                    if not step.groups:
                        if state.prompts_exhausted and state.buffer.outstanding == 0:
                            return
                        state.batch_index += 1  # an in-order batch whose groups were all dropped
                        continue
                    await self._wait_for_weight_push()
                    result = await self._call("finish_train_step", state.stages.finish_train_step, step.batch_index)
                except TrainCallFailed as failure:
                    await self._abort(step, failure)
                    continue
                except StopRequested:
                    await self._drop_open_step(step, outcomes.RUN_STOPPED)
                    return
                await self._close_step(step, result)
        finally:
            state.training_done = True
            state.changed.notify()

    def describe(self) -> str:
        state, step = self.state, self.step
        if state.training_done:
            return "finished"
        if step is None:
            return "starting"
        if self.activity is not None:
            return f"step {step.batch_index}: {self.activity}"
        per_step = state.settings.prompts_per_step
        have = len(step.groups)
        eligible = state.sampler.count_eligible(state.buffer, state.trainer_version, step.batch_index)
        text = (
            f"step {step.batch_index} has {have}/{per_step} groups; waiting for {per_step - have} more "
            f"{state.sampler.describe_wait(state.trainer_version, step.batch_index)}, "
            f"have {eligible} eligible of {state.buffer.count(GroupState.READY)} ready"
        )
        if "train" in state.last_error:
            text += f"; last failure {state.last_error['train']}"
        return text

    async def _fill(self, step: StepBuild) -> None:
        state = self.state
        if state.settings.colocated:
            await self._generation_phase(step)
        while not self._step_complete(step):
            if state.stop_requested:
                raise StopRequested
            for stale in state.sampler.evict(state.buffer, state.trainer_version):
                state.drop(stale, outcomes.TOO_STALE, pump="train")
            open_slots = state.settings.prompts_per_step - len(step.groups)
            group = state.sampler.select(state.buffer, state.trainer_version, step.batch_index, open_slots)
            if group is None:
                await self._wait_unless_stopped()
            else:
                await self._train_group(step, group)

    async def _generation_phase(self, step: StepBuild) -> None:
        """Colocated: the step starts only when all its groups are ready and no
        generator is mid-call; then the generators sleep until it finishes."""
        state, per_step = self.state, self.state.settings.prompts_per_step
        self.activity = "colocated: waiting for the step's groups before the generators sleep"
        while not ((state.sampler.count_eligible(state.buffer, state.trainer_version, step.batch_index) >= per_step
                    or (state.prompts_exhausted and state.buffer.count(GroupState.RESERVED) == 0))
                   and state.generating == 0 and not state.pushing):
            await self._wait_unless_stopped()
        state.generators_asleep = True
        state.changed.notify()
        self.activity = "colocated: putting the generators to sleep"
        await state.stages.sleep_generators()
        self.activity = None

    async def _wake_generators(self) -> None:
        state = self.state
        if state.generators_asleep:
            self.activity = "colocated: waking the generators"
            await state.stages.wake_generators()
            state.generators_asleep = False
            self.activity = None
            state.changed.notify()

    async def _wait_unless_stopped(self) -> None:
        if self.state.stop_requested:
            raise StopRequested
        await self.state.changed.wait()
        if self.state.stop_requested:
            raise StopRequested

    def _step_complete(self, step: StepBuild) -> bool:
        state, per_step = self.state, self.state.settings.prompts_per_step
        if state.settings.order == "in_order":
            batch_dispatched = state.prompts_exhausted or state.groups_dispatched >= (step.batch_index + 1) * per_step
            return batch_dispatched and not any(
                g.target_step == step.batch_index and g.state is not GroupState.CONSUMED for g in state.buffer.groups()
            )
        return len(step.groups) >= per_step or (state.prompts_exhausted and state.buffer.outstanding == 0)

    async def _train_group(self, step: StepBuild, group: Group) -> None:
        state = self.state
        state.buffer.consume(group.group_id)
        step.groups.append(group)
        state.consumed_in_step += 1
        state.changed.notify()
        if not step.begun:
            step.begun = True
            await self._call("begin_train_step", state.stages.begin_train_step, step.batch_index)
        advantages = group_advantages(group.rewards, state.settings.advantage_eps)
        fields = {
            FIELD_REWARD: torch.tensor(group.rewards, dtype=torch.float32),
            FIELD_ADVANTAGE: torch.tensor(advantages, dtype=torch.float32),
        }
        await self._call("the data-plane put of advantages", state.put, group.keys, fields, metered=False)
        await self._call("train_microbatch", state.stages.train_microbatch, step.batch_index, list(group.keys))
        state.progress()

    async def _wait_for_weight_push(self) -> None:
        """The optimizer step must not change weights a push is still reading."""
        self.activity = "waiting for the weight push to end before finish_train_step"
        while self.state.pushing:
            await self.state.changed.wait()
        self.activity = None

    async def _call(self, name: str, fn: Callable[..., Any], *args: Any, metered: bool = True) -> Any:
        self.activity = f"in {name}"
        try:
            if not metered:
                return await resolve(fn(*args))
            with self.state.meter("train").track():
                return await resolve(fn(*args))
        except Exception as error:
            raise TrainCallFailed(name, error) from error
        finally:
            self.activity = None

    async def _close_step(self, step: StepBuild, result: StepResult) -> None:
        state = self.state
        lags: Counter[int] = Counter()
        for group in step.groups:
            lag = group.lag_at(step.version)
            state.ledger.trained(group.keys, lag)
            lags[lag] += len(group.keys)
        state.trainer_version = int(result.version)
        state.finished_steps += 1
        state.batch_index += 1
        state.consumed_in_step = 0
        self._aborted_in_row = 0
        await self._wake_generators()
        state.progress()  # the sync pump starts its push while the clear runs
        await self._clear_and_release(step.groups)
        self._report(step, result, lags)

    async def _abort(self, step: StepBuild, failure: TrainCallFailed) -> None:
        self.state.last_error["train"] = str(failure)
        await self._drop_open_step(step, outcomes.STEP_ABORTED)
        self.aborted_steps += 1
        self._aborted_in_row += 1
        if self._aborted_in_row >= self.state.settings.max_aborted_steps:
            message = f"{self._aborted_in_row} consecutive train steps aborted; last: {failure}"
            raise StepFailed(message) from failure.error

    async def _drop_open_step(self, step: StepBuild, outcome: str) -> None:
        """Abort the trainer's open step and drop its groups as ``outcome``."""
        state = self.state
        if step.begun:
            await resolve(state.stages.abort_train_step(step.batch_index))  # idempotent; a raise here is fatal
        await self._wake_generators()
        for group in step.groups:
            state.ledger.dropped(group.keys, outcome)
        state.consumed_in_step = 0
        await self._clear_and_release(step.groups)

    async def _clear_and_release(self, groups: list[Group]) -> None:
        """The step's one data-plane clear (with keys dropped since the last
        one); slots are freed only once their samples are gone."""
        state = self.state
        await state.clear([key for group in groups for key in group.keys] + state.take_pending_clear())
        for group in groups:
            state.buffer.release(group.group_id)
        state.changed.notify()

    def _report(self, step: StepBuild, result: StepResult, lags: Counter[int]) -> None:
        if self.on_step is None:
            return
        state = self.state
        now = state.clock()
        elapsed = max(now - state.started_at, 1e-9)
        self.on_step(
            {
                "step": state.finished_steps,
                "batch": step.batch_index,
                "version": state.trainer_version,
                "groups": len(step.groups),
                "samples": sum(lags.values()),
                "lag_histogram": dict(sorted(lags.items())),
                "reward_mean": _mean(r for g in step.groups for r in g.rewards if r is not None),
                "step_time_s": now - step.started_at,
                "elapsed_s": elapsed,
                "samples_per_s": state.ledger.trained_count / elapsed,
                "busy": state.busy_fractions(),
                "dropped": state.ledger.summary()["dropped"],
                "trainer": dict(result.metrics),
            }
        )


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None
