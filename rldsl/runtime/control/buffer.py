"""Group-granular replay-buffer metadata with reserve/commit slot accounting.

The buffer never holds sample data (that lives in the data plane under the
sample keys); it tracks prompt groups through their life:

    reserve (dispatched) -> commit (ready) -> consume (in the open step)
                     \\-----------\\--------------\\--> release (cleared or dropped)

A slot is taken at reserve time, so the rollout pump can never dispatch more
groups than the buffer can hold once they land. Consumed groups keep their
slot until the step's single data-plane clear, because their samples are
still stored until then.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass


class GroupState(enum.Enum):
    RESERVED = "reserved"
    READY = "ready"
    CONSUMED = "consumed"


@dataclass
class Group:
    group_id: int  # the prompt's index in the run's prompt stream
    keys: tuple[str, ...]  # live sample keys; failed samples are removed
    target_step: int  # planned step (batch index for in_order)
    version: int  # generation weight version (the dispatch-time one until commit)
    state: GroupState = GroupState.RESERVED
    arrival: int = -1  # commit order; -1 until ready
    rewards: tuple[float, ...] = ()

    def lag_at(self, trainer_version: int) -> int:
        return trainer_version - self.version


class SlotError(RuntimeError):
    """A slot operation that breaks the accounting (a bug in the caller)."""


class ReplayBuffer:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._groups: dict[int, Group] = {}
        self._counts: Counter[GroupState] = Counter()
        self._arrivals = 0

    # -- slot transitions -------------------------------------------------

    def reserve(self, group_id: int, keys: tuple[str, ...], target_step: int, version: int) -> Group:
        if not self.has_room:
            raise SlotError(f"reserve with the buffer full ({self.describe()})")
        if group_id in self._groups:
            raise SlotError(f"group {group_id} is already in the buffer")
        group = Group(group_id, tuple(keys), target_step, version)
        self._groups[group_id] = group
        self._counts[GroupState.RESERVED] += 1
        return group

    def commit(self, group_id: int, keys: tuple[str, ...], rewards: tuple[float, ...], version: int) -> Group:
        """The group's last stage finished: it is ready for training."""
        group = self._expect(group_id, GroupState.RESERVED)
        group.keys, group.rewards, group.version = tuple(keys), tuple(rewards), version
        group.arrival = self._arrivals
        self._arrivals += 1
        self._move(group, GroupState.READY)
        return group

    def consume(self, group_id: int) -> Group:
        """The train pump took the group into the open step."""
        group = self._expect(group_id, GroupState.READY)
        self._move(group, GroupState.CONSUMED)
        return group

    def release(self, group_id: int) -> Group:
        """Free the slot: the group was cleared after its step, or dropped."""
        group = self._groups.pop(group_id, None)
        if group is None:
            raise SlotError(f"release of unknown group {group_id}")
        self._counts[group.state] -= 1
        return group

    # -- queries ------------------------------------------------------------

    def get(self, group_id: int) -> Group | None:
        return self._groups.get(group_id)

    def groups(self, state: GroupState | None = None) -> list[Group]:
        return [g for g in self._groups.values() if state is None or g.state is state]

    def count(self, state: GroupState) -> int:
        return self._counts[state]

    @property
    def occupied(self) -> int:
        return len(self._groups)

    @property
    def outstanding(self) -> int:
        """Groups dispatched or ready but not yet taken by a step."""
        return self._counts[GroupState.RESERVED] + self._counts[GroupState.READY]

    @property
    def has_room(self) -> bool:
        return self.occupied < self.capacity

    def describe(self) -> str:
        return (
            f"{self.occupied}/{self.capacity} groups: "
            f"{self.count(GroupState.RESERVED)} reserved, {self.count(GroupState.READY)} ready, "
            f"{self.count(GroupState.CONSUMED)} consumed by the open step"
        )

    # -- internals ------------------------------------------------------------

    def _expect(self, group_id: int, state: GroupState) -> Group:
        group = self._groups.get(group_id)
        if group is None:
            raise SlotError(f"group {group_id} is not in the buffer")
        if group.state is not state:
            raise SlotError(f"group {group_id} is {group.state.value}, expected {state.value}")
        return group

    def _move(self, group: Group, state: GroupState) -> None:
        self._counts[group.state] -= 1
        self._counts[state] += 1
        group.state = state
