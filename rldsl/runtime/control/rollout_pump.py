"""The rollout pump: prompts -> generate -> reward stages -> logprob stages."""

from __future__ import annotations

import asyncio
import math
from typing import Any, Iterable

from rldsl.runtime.control import ledger as outcomes
from rldsl.runtime.control.advantages import difficulty_masked
from rldsl.runtime.control.buffer import Group, GroupState
from rldsl.runtime.control.coalesce import CoalescedStage
from rldsl.runtime.control.decode_rate import longest_response
from rldsl.runtime.control.errors import WorkerLost
from rldsl.runtime.control.sampler import DispatchPlan
from rldsl.runtime.control.state import GeneratorReplica, RunState
from rldsl.runtime.dataplane.base import sample_key
from rldsl.runtime.protocols import FIELD_BEHAVIOUR_LOGPROBS, ComponentReward, Generated, Prompt, RewardFailure


class RolloutPump:
    """Prompts -> generate -> reward stages -> logprob stages, group by group.

    Each group goes to the awake generator replica holding the fewest, up to
    its concurrency, so every replica has a batch to decode."""

    def __init__(self, state: RunState, prompts: Iterable[Prompt]) -> None:
        self.state = state
        self._prompts = iter(prompts)
        self.tasks: set[asyncio.Task] = set()
        self.zero_variance_drops = 0  # dynamic sampling, for the watchdog's report
        self._reward_calls = {name: self._stage_calls(name, "reward") for name in state.settings.reward_stages}
        self._logprob_calls = {name: self._stage_calls(name, "logprob") for name in state.settings.logprob_stages}

    def _stage_calls(self, stage: str, kind: str):
        """The stage's calls, metered; merged while its slots are busy when
        the lowering says how many it serves at once."""
        state = self.state
        handle = state.stages.reward if kind == "reward" else state.stages.logprob

        async def call(keys: list[str]):
            with state.meter(f"{kind}:{stage}").track():
                return await handle(stage, keys)

        slots = state.stages.stage_slots.get(stage)
        return CoalescedStage(call, slots, state.settings.samples_per_step) if slots else call

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
        if state.prompts_exhausted:
            return "prompt stream exhausted", None
        if not state.buffer.has_room:
            return f"buffer full ({state.buffer.describe()})", None
        in_flight = state.buffer.count(GroupState.RESERVED)
        if in_flight >= settings.max_inflight:
            return f"in-flight limit ({in_flight}/{settings.max_inflight} groups dispatched, not yet ready)", None
        replica = self._pick_replica()
        if replica is None:
            return self._replicas_busy(), None
        plan = state.sampler.plan_dispatch(
            state.buffer, state.train_progress(), replica.version, state.groups_dispatched
        )
        return plan.blocked, plan

    def wants_capacity(self) -> bool:
        """Groups could be dispatched now if a replica had room: the lease
        pump asks for the GPUs of sleeping leased replicas on this."""
        state, settings = self.state, self.state.settings
        if state.training_done or state.prompts_exhausted or not state.buffer.has_room:
            return False
        if state.buffer.count(GroupState.RESERVED) >= settings.max_inflight:
            return False
        plan = state.sampler.plan_dispatch(state.buffer, state.train_progress(), state.exported_version,
                                           state.groups_dispatched)
        return plan.blocked is None

    def _pick_replica(self) -> GeneratorReplica | None:
        """The awake replica with the fewest groups in flight that has room."""
        state = self.state
        open_replicas = [r for r in state.replicas if r.can_take(state.draining_sleepers)]
        return min(open_replicas, key=lambda r: (r.in_flight, r.index), default=None)

    def _replicas_busy(self) -> str:
        state = self.state
        if all(r.lost for r in state.replicas):
            return "every generator replica was lost (its actor died and could not be replaced)"
        if all(r.asleep for r in state.replicas):
            return "colocated generators sleep while the trainer runs"
        parts = []
        for r in state.replicas:
            if r.lost:
                parts.append(f"{r.index} lost")
            elif r.asleep:
                parts.append(f"{r.index} asleep")
            elif r.yielding:
                parts.append(f"{r.index} finishing {r.in_flight} before it gives its GPU back")
            elif state.draining_sleepers and r.shares_trainer_gpus:
                parts.append(f"{r.index} finishing {r.in_flight} before it sleeps")
            else:
                parts.append(f"{r.index} holds {r.in_flight}/{r.concurrency}")
        return "every generator replica is full or asleep (" + ", ".join(parts) + ")"

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
        replica = self._pick_replica()
        keys = tuple(sample_key(settings.pipeline, prompt.index, i) for i in range(settings.samples_per_prompt))
        group = state.buffer.reserve(prompt.index, keys, plan.target_step, replica.version)
        group.replica = replica.index
        state.ledger.register(keys, prompt=prompt.index, replica=replica.index)
        state.groups_dispatched += 1
        replica.in_flight += 1  # counted now, so the replica cannot be put to sleep before the call
        task = asyncio.create_task(self._process(group, prompt, replica))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _process(self, group: Group, prompt: Prompt, replica: GeneratorReplica) -> None:
        state = self.state
        asked = state.clock()
        try:
            generated = await self._generate(group, prompt, replica)
        except Exception as error:  # an engine failure drops the group, never the run
            if isinstance(error, WorkerLost):
                state.lose_replica(error)
            state.drop(group, _failure_reason(error, outcomes.GENERATION_FAILED), error)
            return
        state.decode_rate.record(longest_response(generated.tokens, tuple(generated.sample_tokens),
                                                  state.settings.samples_per_prompt), state.clock() - asked)
        group.tokens = generated.tokens
        group.sample_tokens = dict(zip(group.keys, generated.sample_tokens))
        state.journal.generated(group.keys, generated.version, FIELD_BEHAVIOUR_LOGPROBS,  # every engine records them
                                getattr(generated, "token_versions", ()))
        rewards = await self._score(group)
        if rewards is None:
            return
        if state.settings.dynamic_sampling and len(set(rewards)) == 1:
            state.drop(group, outcomes.ZERO_VARIANCE)  # no signal: its slot goes to another prompt
            self.zero_variance_drops += 1
            state.last_error["rollout"] = (f"dynamic sampling dropped {self.zero_variance_drops} groups whose "
                                           f"rewards were all {rewards[0]}")
            return
        group.masked = difficulty_masked(rewards, state.settings.difficulty_mask)
        if not group.masked and not await self._logprobs(group, generated.version):  # a masked row has no loss
            return
        state.buffer.commit(group.group_id, group.keys, rewards, generated.version)
        state.progress()

    async def _generate(self, group: Group, prompt: Prompt, replica: GeneratorReplica) -> Generated:
        state, settings = self.state, self.state.settings
        seed = (settings.seed * 1_000_003 + prompt.index) % (1 << 31)
        try:
            with state.meter("generate").track():
                return await state.stages.generate(
                    replica.index, [prompt], list(group.keys), settings.samples_per_prompt, seed
                )
        finally:
            replica.in_flight -= 1
            state.changed.notify()

    async def _score(self, group: Group) -> tuple[float, ...] | None:
        """Sum the reward stages per sample; failed samples are dropped with
        their reason. Returns the survivors' rewards, or None when none survived."""
        state = self.state
        totals = dict.fromkeys(group.keys, 0.0)
        parts: dict[str, dict[str, float]] = {key: {} for key in group.keys}  # named components, per sample
        stats: dict[str, dict[str, float]] = {key: {} for key in group.keys}  # episode statistics, per sample
        for stage in state.settings.reward_stages:
            alive = list(totals)
            outcomes_by_reason: dict[str, list[str]] = {}
            for key, reward in zip(alive, await self._reward_stage(stage, alive)):
                if isinstance(reward, RewardFailure):
                    outcomes_by_reason.setdefault(reward.reason, []).append(key)
                    del totals[key]
                else:
                    totals[key] += reward
                    parts[key].update(getattr(reward, "parts", {}))
                    stats[key].update(getattr(reward, "stats", {}))
            for reason, failed in outcomes_by_reason.items():
                state.ledger.dropped(failed, reason)
                state.pending_clear.extend(failed)
        group.keys = tuple(totals)
        group.reward_parts = tuple(parts[key] for key in totals) if any(parts.values()) else ()
        group.episode_stats = tuple(stats[key] for key in totals) if any(stats.values()) else ()
        if group.episode_stats:
            state.journal.episodes(group.keys, group.episode_stats)
        if not totals:
            state.buffer.release(group.group_id)
            state.changed.notify()
            return None
        return tuple(totals.values())

    async def _reward_stage(self, stage: str, keys: list[str]) -> list[float | RewardFailure]:
        """One reward per key, or why that key has none; a raising stage fails all."""
        state = self.state
        try:
            results = list(await self._reward_calls[stage](keys))
            if len(results) != len(keys):
                raise ValueError(f"{len(results)} rewards for {len(keys)} samples")
        except Exception as error:
            state.last_error["rollout"] = f"{outcomes.REWARD_FAILED} ({stage}): {error!r}"
            return [RewardFailure(_failure_reason(error, outcomes.REWARD_FAILED), repr(error))] * len(keys)
        checked = [_reward_or_failure(r) for r in results]
        failure = next((r for r in checked if isinstance(r, RewardFailure)), None)
        if failure is not None:
            state.last_error["rollout"] = f"{failure.reason} ({stage}): {failure.detail}"
        return checked

    async def _logprobs(self, group: Group, generated_at: int) -> bool:
        state = self.state
        for stage in state.settings.logprob_stages:
            if stage in state.settings.batch_start_logprob_stages:
                continue  # the train pump calls it, at the trainer's version (train_pump.py)
            if stage in state.settings.policy_logprob_stages:
                await self._receivers_hold(generated_at)
            receivers_at_call = state.receivers_version
            try:
                versions = await self._logprob_calls[stage](list(group.keys))
            except Exception as error:
                state.drop(group, _failure_reason(error, outcomes.LOGPROB_FAILED), error)
                return False
            state.journal_logprob(group.keys, stage, receivers_at_call, versions[0] if versions else None)
        return True


    async def _receivers_hold(self, version: int) -> None:
        """A policy logprob stage scores each row with the weights that
        generated it: a push of that version still in transit lands first."""
        state = self.state
        while state.receivers_version < version and not state.training_done:
            await state.changed.wait()


def _failure_reason(error: BaseException, otherwise: str) -> str:
    """``worker_died`` when the stage's actor was lost (the lowering already
    tried a replacement), else the stage's own failure reason."""
    return outcomes.WORKER_DIED if isinstance(error, WorkerLost) else otherwise


def _reward_or_failure(value: Any) -> float | RewardFailure:
    """A finite float, or the reason there is none (None: the stage gave no reason)."""
    if isinstance(value, RewardFailure):
        return value
    if value is None:
        return RewardFailure(outcomes.REWARD_FAILED, "no reward")
    try:
        number = float(value)
    except (TypeError, ValueError):
        return RewardFailure(outcomes.REWARD_INVALID, f"not a number: {value!r}")
    if not math.isfinite(number):
        return RewardFailure(outcomes.REWARD_INVALID, f"not finite: {number}")
    return value if isinstance(value, ComponentReward) else number  # it keeps its parts
