"""Group-granular replay-buffer metadata with reserve/commit slot accounting.

The buffer never holds sample data (that lives in the data plane under the
sample keys); it tracks prompt groups through their life:

    reserve (dispatched) -> commit (ready) -> consume (in the open step)
                     \\-----------\\--------------\\--> release (cleared or dropped)

A slot is taken at reserve time, so the rollout pump can never dispatch more
groups than the buffer can hold once they land. Consumed groups keep their
slot until the step's single data-plane clear, because their samples are
still stored until then.

The buffer keeps its groups indexed by state, by generation version (ready
groups, in arrival order) and by planned step, so the sampler's questions
cost O(versions in the window), not O(groups in the buffer).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator


class GroupState(enum.Enum):
    RESERVED = "reserved"
    READY = "ready"
    CONSUMED = "consumed"


@dataclass(eq=False)
class Group:
    group_id: int  # the prompt's index in the run's prompt stream
    keys: tuple[str, ...]  # live sample keys; failed samples are removed
    target_step: int  # planned step (batch index for in_order)
    version: int  # generation weight version (the dispatch-time one until commit)
    state: GroupState = GroupState.RESERVED
    arrival: int = -1  # commit order; -1 until ready
    rewards: tuple[float, ...] = ()
    reward_parts: tuple[dict[str, float], ...] = ()  # each sample's named reward components (if any)
    episode_stats: tuple[dict[str, float], ...] = ()  # each sample's episode statistics (turns, tool calls), if any
    tokens: int = 0  # response tokens, for balancing data-parallel ranks
    sample_tokens: dict[str, int] = field(default_factory=dict)  # each sample's trained tokens (batch_tokens)
    masked: bool = False  # a difficulty mask keeps it out of the loss: in its step, never trained
    replica: int = -1  # the generator replica it was dispatched to
    refused: frozenset[str] = frozenset()  # keys the trainer fenced out (stale behaviour logprobs)

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
        self._by_state: dict[GroupState, dict[int, Group]] = {state: {} for state in GroupState}
        self._versions: dict[GroupState, Counter[int]] = {state: Counter() for state in GroupState}
        self._ready_by_version: dict[int, dict[int, Group]] = {}  # arrival order within a version
        self._ready_by_target: dict[int, dict[int, Group]] = {}
        self._unconsumed_by_target: Counter[int] = Counter()
        self._arrivals = 0

    # -- slot transitions -------------------------------------------------

    def reserve(self, group_id: int, keys: tuple[str, ...], target_step: int, version: int) -> Group:
        if not self.has_room:
            raise SlotError(f"reserve with the buffer full ({self.describe()})")
        if group_id in self._groups:
            raise SlotError(f"group {group_id} is already in the buffer")
        group = Group(group_id, tuple(keys), target_step, version)
        self._groups[group_id] = group
        self._enter(group)
        self._unconsumed_by_target[target_step] += 1
        return group

    def commit(self, group_id: int, keys: tuple[str, ...], rewards: tuple[float, ...], version: int) -> Group:
        """The group's last stage finished: it is ready for training."""
        group = self._expect(group_id, GroupState.RESERVED)
        self._leave(group)
        group.keys, group.rewards, group.version = tuple(keys), tuple(rewards), version
        group.arrival = self._arrivals
        self._arrivals += 1
        group.state = GroupState.READY
        self._enter(group)
        return group

    def consume(self, group_id: int) -> Group:
        """The train pump took the group into the open step."""
        group = self._expect(group_id, GroupState.READY)
        self._leave(group)
        group.state = GroupState.CONSUMED
        self._enter(group)
        self._unconsumed_by_target[group.target_step] -= 1
        return group

    def release(self, group_id: int) -> Group:
        """Free the slot: the group was cleared after its step, or dropped."""
        group = self._groups.pop(group_id, None)
        if group is None:
            raise SlotError(f"release of unknown group {group_id}")
        self._leave(group)
        if group.state is not GroupState.CONSUMED:
            self._unconsumed_by_target[group.target_step] -= 1
        return group

    # -- queries ------------------------------------------------------------

    def get(self, group_id: int) -> Group | None:
        return self._groups.get(group_id)

    def groups(self, state: GroupState | None = None) -> list[Group]:
        if state is None:
            return list(self._groups.values())
        return list(self._by_state[state].values())

    def count(self, state: GroupState) -> int:
        return len(self._by_state[state])

    def version_counts(self, state: GroupState) -> Counter[int]:
        """Groups in ``state`` per generation version (read-only)."""
        return self._versions[state]

    def ready_versions(self) -> list[int]:
        """Versions that have ready groups, newest first."""
        return sorted(self._ready_by_version, reverse=True)

    def ready_at(self, version: int) -> Iterator[Group]:
        """Ready groups generated at ``version``, in arrival order."""
        return iter(self._ready_by_version.get(version, {}).values())

    def ready_for(self, target_step: int) -> list[Group]:
        return list(self._ready_by_target.get(target_step, {}).values())

    def unconsumed_for(self, target_step: int) -> int:
        """Groups planned for ``target_step`` still reserved or ready."""
        return self._unconsumed_by_target[target_step]

    @property
    def occupied(self) -> int:
        return len(self._groups)

    @property
    def outstanding(self) -> int:
        """Groups dispatched or ready but not yet taken by a step."""
        return self.count(GroupState.RESERVED) + self.count(GroupState.READY)

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

    def _enter(self, group: Group) -> None:
        self._by_state[group.state][group.group_id] = group
        self._versions[group.state][group.version] += 1
        if group.state is GroupState.READY:
            self._ready_by_version.setdefault(group.version, {})[group.group_id] = group
            self._ready_by_target.setdefault(group.target_step, {})[group.group_id] = group

    def _leave(self, group: Group) -> None:
        del self._by_state[group.state][group.group_id]
        counts = self._versions[group.state]
        counts[group.version] -= 1
        if not counts[group.version]:
            del counts[group.version]
        if group.state is GroupState.READY:
            _discard(self._ready_by_version, group.version, group.group_id)
            _discard(self._ready_by_target, group.target_step, group.group_id)


def _discard(index: dict[int, dict[int, Group]], bucket: int, group_id: int) -> None:
    groups = index[bucket]
    del groups[group_id]
    if not groups:
        del index[bucket]
