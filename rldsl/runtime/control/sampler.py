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
- the train side (``select`` / ``evict``): one ready group at a time for the
  open step, eligible iff its lag is within bound, ordered by (lag, arrival),
  but never at the price of an older group's deadline (see ``select``).

A step is identified by its *batch index*: steps finished plus in-order
batches skipped because all their groups were dropped; an aborted step is
retried under the same index. The trainer version moves only when a step
finishes.
"""

from __future__ import annotations

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
            target = groups_dispatched // self.per_step
            steps_ahead = target - progress.batch_index
        else:
            steps_ahead = (progress.consumed_in_step + buffer.outstanding) // self.per_step
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
        return DispatchPlan(target, train_version, blocked)

    # -- train side -------------------------------------------------------------

    def evict(self, buffer: ReplayBuffer, trainer_version: int) -> list[Group]:
        """Ready groups that can no longer be trained within the bound.

        Lag only grows, so keeping them would hold slots forever. Under
        ``too_stale = "wait"`` selection lets no group expire, so this finds
        nothing unless an engine reported an unexpected version."""
        return [g for g in buffer.groups(GroupState.READY) if g.lag_at(trainer_version) > self.max_lag]

    def select(
        self, buffer: ReplayBuffer, trainer_version: int, batch_index: int, open_slots: int
    ) -> Group | None:
        """The best ready group for the open step, or None to wait.

        Best is lowest lag, then earliest arrival, among the groups whose
        taking lets every protected group still train before its deadline
        (version + max_lag): the ready ones, and with ``too_stale = "wait"``
        the ones still in flight too. Without that guard a fresher group
        would push older ready ones past their deadline and waste them."""
        candidates = [g for g in buffer.groups(GroupState.READY) if self._eligible(g, trainer_version, batch_index)]
        candidates.sort(key=lambda g: (g.lag_at(trainer_version), g.arrival))
        if self.in_order or not candidates:
            return candidates[0] if candidates else None
        protected = buffer.groups(GroupState.READY)
        if self.wait_for_expiring:
            protected += buffer.groups(GroupState.RESERVED)
        if not self._fits(protected, trainer_version, open_slots):
            # something expires whatever we do: save the oldest
            return max(candidates, key=lambda g: (g.lag_at(trainer_version), -g.arrival))
        for group in candidates:
            if self._fits([g for g in protected if g is not group], trainer_version, open_slots - 1):
                return group
        return None  # every ready group would let an older one in flight expire: wait for it

    def count_eligible(self, buffer: ReplayBuffer, trainer_version: int, batch_index: int) -> int:
        return sum(self._eligible(g, trainer_version, batch_index) for g in buffer.groups(GroupState.READY))

    def describe_wait(self, trainer_version: int, batch_index: int) -> str:
        if self.in_order:
            return f"groups planned for step {batch_index} (in order) at version {trainer_version}"
        return f"ready groups with lag <= {self.max_lag} at version {trainer_version}"

    def _eligible(self, group: Group, trainer_version: int, batch_index: int) -> bool:
        if group.lag_at(trainer_version) > self.max_lag:
            return False
        return not self.in_order or group.target_step == batch_index

    def _fits(self, groups: list[Group], trainer_version: int, open_slots: int) -> bool:
        """Earliest-deadline feasibility: can every group still be trained by
        its deadline, given ``open_slots`` in the open step and
        ``prompts_per_step`` in each later one? (Expired groups are ignored:
        eviction handles them.)"""
        deadlines = sorted(g.version + self.max_lag for g in groups if g.version + self.max_lag >= trainer_version)
        for count, deadline in enumerate(deadlines, start=1):
            if count > open_slots + (deadline - trainer_version) * self.per_step:
                return False
        return True
