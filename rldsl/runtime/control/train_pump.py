"""The train pump: the split-step trainer fed ready groups as they arrive."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rldsl.runtime.control import ledger as outcomes
from rldsl.runtime.control.advantages import compute_advantages, needs_tokens, needs_whole_batch
from rldsl.runtime.control.buffer import Group, GroupState
from rldsl.runtime.control.errors import StepFailed, StopRequested, TrainCallFailed, WorkerLost, trainer_lost
from rldsl.runtime.control.exports import Exports
from rldsl.runtime.control.gpu_turns import GpuTurns
from rldsl.runtime.control.lanes import MicrobatchLanes
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


class TrainPump(GpuTurns, Exports):
    """Builds each step from ready groups: lazy begin, one microbatch per group
    as it arrives (all data-parallel replicas busy at once, see lanes.py),
    one finish, one weight export and one data-plane clear; abort on failure."""

    def __init__(self, state: RunState, on_step: StepCallback | None) -> None:
        self.state = state
        self.on_step = on_step
        self.step: StepBuild | None = None
        self.activity: str | None = None  # what the pump awaits besides groups, for the watchdog
        self.aborted_steps = 0
        self._aborted_in_row = 0
        self.lanes = MicrobatchLanes(state.stages.train_replicas, state.changed.notify,
                                     stopping=lambda: state.stop_requested)

    async def run(self) -> None:
        state = self.state
        try:
            await self._steps()
            await self._settle_export()  # the last version reaches its receivers before training is done
        finally:
            self._forget_export()
            self.lanes.cancel()
            state.training_done = True
            state.changed.notify()

    async def _steps(self) -> None:
        state = self.state
        while state.finished_steps < state.settings.steps and not state.stop_requested:
            step = self.step = StepBuild(state.batch_index, state.trainer_version, state.clock())
            try:
                await self._fill(step)
                if not step.groups:
                    if state.prompts_exhausted and state.buffer.outstanding == 0:
                        return
                    state.batch_index += 1  # an in-order batch whose groups were all dropped
                    continue
                await self._settle_export()
                result = await self._call("finish_train_step", state.stages.finish_train_step, step.batch_index)
            except TrainCallFailed as failure:
                await self._abort(step, failure)
                continue
            except StopRequested:
                await self._drop_open_step(step, outcomes.RUN_STOPPED)
                return
            await self._close_step(step, result)

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
        if self.lanes.in_flight:
            text += f"; {self.lanes.describe()}"
        if self._export_task is not None:
            text += f"; weights version {state.trainer_version} still exporting"
        if "train" in state.last_error:
            text += f"; last failure {state.last_error['train']}"
        return text

    async def _fill(self, step: StepBuild) -> None:
        """Pass one streams: a group's microbatch starts as soon as it is
        ready (unless its advantages need the whole rollout batch), with an
        optimizer step after each mini-batch. Later passes replay the step's
        groups, still in the data plane, in a seeded order."""
        state = self.state
        if state.settings.takes_turns:
            await self._generation_phase(step)
        streaming = not needs_whole_batch(state.settings.normalize)
        self.lanes.open_step(state.settings.minibatch_groups)
        while not self._step_complete(step) and self.lanes.failure is None:
            if state.stop_requested:
                raise StopRequested
            for stale in state.sampler.evict(state.buffer, state.trainer_version):
                state.drop(stale, outcomes.TOO_STALE, pump="train")
            open_slots = state.settings.prompts_per_step - len(step.groups)
            group = state.sampler.select(state.buffer, state.trainer_version, step.batch_index, open_slots)
            if group is None:
                await self._wait_unless_stopped()
                continue
            await self._start_group(step, group, streaming)
            if streaming and self._minibatch_ends(step):
                await self._optimizer_step(step)
                self.lanes.open_step(state.settings.minibatch_groups)
        await self._drain()
        if not streaming and step.groups:
            await self._train_pass(step, step.groups, self._batch_advantages(step.groups))
        for epoch in range(1, state.settings.ppo_epochs):
            await self._optimizer_step(step)
            await self._train_pass(step, self._epoch_order(step, epoch), None)

    def _minibatch_ends(self, step: StepBuild) -> bool:
        """Pass one has just queued a mini-batch's last group, and more groups follow in this step."""
        per_step, taken = self.state.settings.prompts_per_step, len(step.groups)
        return taken % self.state.settings.minibatch_groups == 0 and taken < per_step

    async def _train_pass(self, step: StepBuild, groups: list[Group],
                          advantages: dict[int, list[float]] | None) -> None:
        """One pass over ``groups`` in mini-batches, an optimizer step between them."""
        size = self.state.settings.minibatch_groups
        for start in range(0, len(groups), size):
            if start:
                await self._optimizer_step(step)
            chunk = groups[start:start + size]
            self.lanes.open_step(len(chunk))
            for group in (g for g in chunk if not g.masked):  # a masked group is in the step, not the loss
                replica = self.lanes.assign(group.tokens)
                own = None if advantages is None else advantages[group.group_id]
                self.lanes.submit(replica, lambda g=group, r=replica, a=own: self._microbatch(step, g, r, a))
            await self._drain()

    def _epoch_order(self, step: StepBuild, epoch: int) -> list[Group]:
        order = list(step.groups)
        random.Random(f"{self.state.settings.seed}-{step.batch_index}-{epoch}").shuffle(order)
        return order

    def _batch_advantages(self, groups: list[Group]) -> dict[int, list[float]]:
        """Masked groups are left out: they weigh in no batch statistic."""
        trained = [group for group in groups if not group.masked]
        return {group.group_id: advantage for group, advantage in zip(trained, self._advantages(trained))}

    def _advantages(self, groups: list[Group]) -> list[list[float]]:
        settings = self.state.settings
        return compute_advantages([list(g.rewards) for g in groups], settings.advantage, settings.normalize,
                                  settings.advantage_eps, settings.reward_clip, settings.advantage_clip,
                                  reward_scale=settings.reward_scale, reward_bias=settings.reward_bias,
                                  tokens=_sample_tokens(groups) if needs_tokens(settings.normalize) else None,
                                  std=settings.advantage_std, reward_clip_at=settings.reward_clip_at)

    async def _drain(self) -> None:
        self.activity = f"waiting for the step's last microbatches: {self.lanes.describe()}"
        failure = await self.lanes.drain()
        self.activity = None
        if failure is not None:
            raise failure
        if self.state.stop_requested:
            raise StopRequested

    async def _optimizer_step(self, step: StepBuild) -> None:
        """A mini-batch's optimizer step inside the open step (no new weight
        version), once none of its microbatches runs."""
        await self._drain()
        await self._settle_export()
        call = self.state.stages.optimizer_step
        if call is None:
            raise TrainCallFailed("optimizer_step", RuntimeError("these stages take one optimizer step per rollout "
                                                                 "batch: leave global_batch and ppo_epochs out"))
        await self._call("optimizer_step", call, step.batch_index)

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
            return batch_dispatched and state.buffer.unconsumed_for(step.batch_index) == 0
        return len(step.groups) >= per_step or (state.prompts_exhausted and state.buffer.outstanding == 0)

    async def _start_group(self, step: StepBuild, group: Group, stream: bool = True) -> None:
        """Take the group into the step and (streaming) queue its microbatch;
        the pump goes on selecting while it runs."""
        state = self.state
        state.buffer.consume(group.group_id)
        step.groups.append(group)
        state.consumed_in_step += 1
        state.changed.notify()
        if not step.begun:
            step.begun = True
            await self._call("begin_train_step", state.stages.begin_train_step, step.batch_index)
        if stream and not group.masked:
            replica = self.lanes.assign(group.tokens)
            (advantages,) = self._advantages([group])
            self.lanes.submit(replica, lambda: self._microbatch(step, group, replica, advantages))

    async def _microbatch(self, step: StepBuild, group: Group, replica: int, advantages: list[float] | None) -> None:
        """Train one group on ``replica``; its rewards and ``advantages`` go to
        the data plane first (None: a later pass, they are there already)."""
        state = self.state
        if advantages is not None:  # the group's first pass
            await self._recompute_logprobs(step, group)
            fields = {
                FIELD_REWARD: torch.tensor(group.rewards, dtype=torch.float32),
                FIELD_ADVANTAGE: torch.tensor(advantages, dtype=torch.float32),
            }
            try:
                await state.put(group.keys, fields)
            except Exception as error:
                raise TrainCallFailed("the data-plane put of advantages", error) from error
        try:
            with state.meter("train").track():
                result = await state.stages.train_microbatch(step.batch_index, list(group.keys), replica)
        except Exception as error:
            raise TrainCallFailed("train_microbatch", error) from error
        refused = result.get("refused_keys") if isinstance(result, dict) else None
        if refused:
            group.refused = frozenset(refused) & frozenset(group.keys)
        state.progress()

    async def _recompute_logprobs(self, step: StepBuild, group: Group) -> None:
        """``recompute = batch_start`` (verl's and ROLL's old-log-prob
        recompute): the group's behaviour logprobs, scored with the weights
        the trainer holds at the step's start (its version until finish:
        mini-batch optimizer steps push nothing), once that version has
        reached the stage. The fence then compares with the trainer's version."""
        state = self.state
        for stage in state.settings.batch_start_logprob_stages:
            while state.receivers_version < step.version:
                await self._wait_unless_stopped()
            try:
                with state.meter(f"logprob:{stage}").track():
                    versions = await state.stages.logprob(stage, list(group.keys), step.version)
            except Exception as error:
                raise TrainCallFailed(f"the batch-start logprobs of `{stage}`", error) from error
            state.journal_logprob(group.keys, stage, step.version, versions[0] if versions else None,
                                  batch_start=True)

    async def _call(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.activity = f"in {name}"
        try:
            with self.state.meter("train").track():
                return await resolve(fn(*args))
        except Exception as error:
            raise TrainCallFailed(name, error) from error
        finally:
            self.activity = None

    async def _close_step(self, step: StepBuild, result: StepResult) -> None:
        state = self.state
        lags: Counter[int] = Counter()
        skipped = bool((result.metrics or {}).get("skipped"))  # the weights did not change: nothing was trained
        for group in step.groups:
            if group.masked:
                state.ledger.masked(group.keys, step=state.finished_steps + 1)
                continue
            lag = group.lag_at(step.version)
            trained = [key for key in group.keys if key not in group.refused]
            if skipped:
                state.ledger.dropped(trained, outcomes.STEP_SKIPPED)
                trained = []
            else:
                state.ledger.trained(trained, lag, step=state.finished_steps + 1, version=step.version)
            if group.refused:  # the trainer's fence masked them out of the loss
                state.ledger.dropped(sorted(group.refused), outcomes.STALE_LOGPROBS)
            lags[lag] += len(trained)
        state.trainer_version = int(result.version)
        state.finished_steps += 1
        state.batch_index += 1
        state.consumed_in_step = 0
        self._aborted_in_row = 0
        await self._start_export(state.trainer_version)
        await self._wake_generators()
        state.progress()  # the sync pump starts its push while the clear runs
        await self._clear_and_release(step.groups)
        self._report(step, result, lags)

    async def _abort(self, step: StepBuild, failure: TrainCallFailed) -> None:
        self.state.last_error["train"] = str(failure)
        await self._drop_open_step(step, outcomes.STEP_ABORTED)
        self.aborted_steps += 1
        self._aborted_in_row += 1
        if isinstance(failure.error, WorkerLost):  # a trainer rank died: no later step can succeed
            raise trainer_lost(failure.error, failure.call) from failure.error
        if self._aborted_in_row >= self.state.settings.max_aborted_steps:
            message = f"{self._aborted_in_row} consecutive train steps aborted; last: {failure}"
            raise StepFailed(message) from failure.error

    async def _drop_open_step(self, step: StepBuild, outcome: str) -> None:
        """Abort the trainer's open step, once none of its microbatches runs,
        and drop its groups as ``outcome``."""
        state = self.state
        await self.lanes.drain()
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
                **({"masked": sum(len(g.keys) for g in step.groups if g.masked)}
                   if state.settings.difficulty_mask else {}),
                "trainer": dict(result.metrics),
                **_component_means(step.groups),
                **_episode_means(step.groups),
            }
        )


def _sample_tokens(groups: list[Group]) -> list[list[int]]:
    """Each sample's trained tokens, as its generator reported them (`batch_tokens`, `group_batch_tokens`)."""
    missing = [group.group_id for group in groups if any(key not in group.sample_tokens for key in group.keys)]
    if missing:
        raise RuntimeError(f"a token-weighted normalize: the generate stage reported no per-sample token counts for "
                           f"prompt groups {missing[:5]}; its engine must fill Generated.sample_tokens")
    return [[group.sample_tokens[key] for key in group.keys] for group in groups]


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _episode_means(groups) -> dict:
    """``{"episode_stats": {name: mean}}`` over the step's episodes (turns,
    tool calls), when its samples are episodes."""
    names = dict.fromkeys(name for g in groups for stats in g.episode_stats for name in stats)
    if not names:
        return {}
    return {"episode_stats": {name: _mean(stats[name] for g in groups for stats in g.episode_stats
                                          if name in stats) for name in names}}


def _component_means(groups) -> dict:
    """``{"reward_components": {name: mean}}`` over the step's samples, when
    a reward stage has named components (else nothing: the record is as before)."""
    names = dict.fromkeys(name for g in groups for parts in g.reward_parts for name in parts)
    if not names:
        return {}
    return {"reward_components": {name: _mean(parts[name] for g in groups for parts in g.reward_parts
                                              if name in parts) for name in names}}
