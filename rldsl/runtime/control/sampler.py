"""The staleness sampler and the per-version dispatch quota.

Both sides of the staleness bound live here, so they agree on the arithmetic:

- the rollout side (``plan_dispatch``): a prompt group is dispatched only if
  it can be trained within ``max_lag``. Groups already outstanding (reserved
  or ready) fill the open step and the steps after it, ``prompts_per_step``
  each, so a new group is expected to train ``k`` steps ahead of the trainer;
  it is generated with the generator's current weights, so its lag will be
  ``trainer_version + k - generator_version``, and it waits if that exceeds
  ``max_lag``. With ``order = "in_order"`` the planned step is fixed at
  dispatch (strictly in prompt order) and the train pump honours it.
  ``max_ahead`` refines the same arithmetic to whole groups: counted from
  the open step, the generator's version ``g`` fills the steps up to the one
  trained at ``g`` freshly, and at most ``ahead_groups`` more; so at most
  that many groups generated before any version ``v`` train at or after it
  (the proof is in docs/language.md#staleness; `rldsl audit` checks it).
  Unset, ``ahead_groups`` is ``max_lag`` steps and the check is the lag's.
- the train side (``select`` / ``evict``): one ready group at a time for the
  open step, eligible iff its lag is within bound, ordered by (lag, arrival),
  but never at the price of an older group's deadline (see ``select``).

A step is identified by its *batch index*: steps finished plus in-order
batches skipped because all their groups were dropped; an aborted step is
retried under the same index. The trainer version moves only when a step
finishes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rldsl.runtime.control.buffer import Group, GroupState, ReplayBuffer
from rldsl.runtime.control.settings import RunSettings


@dataclass(frozen=True)
class TrainProgress:
    """Where the train pump stands, as the rollout side needs to see it."""

    trainer_version: int
    batch_index: int  # the open (or next) step's batch index
    consumed_in_step: int  # groups the open step has taken so far
    finished_steps: int


@dataclass(frozen=True)
class DispatchPlan:
    target_step: int  # batch index the group is planned for
    train_version: int  # trainer version it is expected to be trained at
    blocked: str | None  # why it may not be dispatched now; None = go


class StalenessSampler:
    def __init__(self, settings: RunSettings) -> None:
        self.max_lag = settings.max_lag
        self.max_ahead = settings.max_ahead
        self.ahead_groups = settings.ahead_groups
        self.in_order = settings.order == "in_order"
        self.wait_for_expiring = settings.too_stale == "wait"
        self.per_step = settings.prompts_per_step
        self.total_steps = settings.steps

    # -- rollout side ---------------------------------------------------------

    def plan_dispatch(
        self, buffer: ReplayBuffer, progress: TrainProgress, generator_version: int, groups_dispatched: int
    ) -> DispatchPlan:
        """Plan the next prompt group; ``groups_dispatched`` counts groups
        dispatched so far (only used for in-order targets)."""
        if self.in_order:
            position = groups_dispatched - progress.batch_index * self.per_step
        else:
            position = progress.consumed_in_step + buffer.outstanding
        steps_ahead = position // self.per_step
        target = progress.batch_index + steps_ahead
        train_version = progress.trainer_version + steps_ahead
        blocked = None
        if progress.finished_steps + steps_ahead >= self.total_steps:
            blocked = f"enough groups dispatched for the remaining {self.total_steps - progress.finished_steps} steps"
        elif train_version - generator_version > self.max_lag:
            blocked = (
                f"staleness bound: the next group would train at version {train_version} with generator "
                f"version {generator_version} (lag {train_version - generator_version} > max_lag {self.max_lag})"
            )
        elif self.max_ahead is not None:
            blocked = self._ahead_blocked(position, progress.trainer_version, generator_version)
        return DispatchPlan(target, train_version, blocked)

    def _ahead_blocked(self, position: int, trainer_version: int, generator_version: int) -> str | None:
        """Counted from the open step's start (the new group's place is
        ``position``), the steps up to the one trained at
        ``generator_version`` take its groups freshly; the new group may lie
        at most ``ahead_groups`` past them."""
        ahead = position + 1 - (generator_version - trainer_version + 1) * self.per_step
        if ahead <= self.ahead_groups:
            return None
        return (f"staleness bound: with the next group, {ahead} groups generated with weights version "
                f"{generator_version} or older would train at a later version (max_ahead {self.max_ahead:g} x "
                f"{self.per_step} prompts per step allows {self.ahead_groups})")

    # -- train side -------------------------------------------------------------

    def evict(self, buffer: ReplayBuffer, trainer_version: int) -> list[Group]:
        """Ready groups that can no longer be trained within the bound.

        Lag only grows, so keeping them would hold slots forever. Under
        ``too_stale = "wait"`` selection lets no group expire, so this finds
        nothing unless an engine reported an unexpected version."""
        oldest_allowed = trainer_version - self.max_lag
        return [g for v in buffer.ready_versions() if v < oldest_allowed for g in buffer.ready_at(v)]

    def select(
        self, buffer: ReplayBuffer, trainer_version: int, batch_index: int, open_slots: int
    ) -> Group | None:
        """The best ready group for the open step, or None to wait.

        Best is lowest lag, then earliest arrival, among the groups whose
        taking lets every protected group still train before its deadline
        (version + max_lag): the ready ones, and with ``too_stale = "wait"``
        the ones still in flight too. Without that guard a fresher group
        would push older ready ones past their deadline and waste them.

        Groups are bucketed by version, so a choice costs O(max_lag^2)
        whatever the buffer holds."""
        if self.in_order:
            candidates = [g for g in buffer.ready_for(batch_index) if self._eligible(g, trainer_version, batch_index)]
            return min(candidates, key=lambda g: (g.lag_at(trainer_version), g.arrival), default=None)
        versions = [v for v in buffer.ready_versions() if trainer_version - v <= self.max_lag]  # lowest lag first
        if not versions:
            return None
        deadlines = self._protected_deadlines(buffer, trainer_version)
        if not _fits(deadlines, trainer_version, open_slots, self.per_step):
            return next(buffer.ready_at(versions[-1]))  # something expires whatever we do: save the oldest
        for version in versions:
            if _fits(deadlines, trainer_version, open_slots, self.per_step, taken=version + self.max_lag):
                return next(buffer.ready_at(version))
        return None  # every ready group would let an older one in flight expire: wait for it

    def count_eligible(self, buffer: ReplayBuffer, trainer_version: int, batch_index: int) -> int:
        if self.in_order:
            return sum(self._eligible(g, trainer_version, batch_index) for g in buffer.ready_for(batch_index))
        counts = buffer.version_counts(GroupState.READY)
        return sum(n for v, n in counts.items() if trainer_version - v <= self.max_lag)

    def describe_wait(self, trainer_version: int, batch_index: int) -> str:
        if self.in_order:
            return f"groups planned for step {batch_index} (in order) at version {trainer_version}"
        return f"ready groups with lag <= {self.max_lag} at version {trainer_version}"

    def _eligible(self, group: Group, trainer_version: int, batch_index: int) -> bool:
        if group.lag_at(trainer_version) > self.max_lag:
            return False
        return not self.in_order or group.target_step == batch_index

    def _protected_deadlines(self, buffer: ReplayBuffer, trainer_version: int) -> Counter[int]:
        """Protected groups per deadline (version + max_lag); expired ones are
        left out (eviction handles them)."""
        deadlines: Counter[int] = Counter()
        states = (GroupState.READY, GroupState.RESERVED) if self.wait_for_expiring else (GroupState.READY,)
        for state in states:
            for version, count in buffer.version_counts(state).items():
                if version + self.max_lag >= trainer_version:
                    deadlines[version + self.max_lag] += count
        return deadlines


def _fits(deadlines: Counter[int], trainer_version: int, open_slots: int, per_step: int,
          taken: int | None = None) -> bool:
    """Earliest-deadline feasibility: can every protected group still be
    trained by its deadline, given ``open_slots`` in the open step and
    ``per_step`` in each later one? With ``taken`` (a deadline), one group of
    that deadline is taken into the open step first: it leaves the set and
    uses a slot, which tightens every earlier deadline by one and leaves the
    later ones as they were."""
    trained_by = 0
    for deadline in sorted(deadlines):
        trained_by += deadlines[deadline]
        room = open_slots + (deadline - trainer_version) * per_step
        if taken is not None and deadline < taken:
            room -= 1
        if trained_by > room:
            return False
    return True
