"""Reserve/commit slot accounting, the staleness sampler and the dispatch quota."""

from __future__ import annotations

import pytest

from rldsl.runtime.control.buffer import GroupState, ReplayBuffer, SlotError
from rldsl.runtime.control.sampler import StalenessSampler, TrainProgress
from rldsl.runtime.control.settings import RunSettings


def keys(group_id: int, samples: int = 2) -> tuple[str, ...]:
    return tuple(f"t/p{group_id}/s{i}" for i in range(samples))


def settings(**overrides) -> RunSettings:
    values = dict(pipeline="t", prompts_per_step=2, samples_per_prompt=2, steps=10, max_lag=1)
    values.update(overrides)
    return RunSettings(**values)


def ready(buffer: ReplayBuffer, group_id: int, version: int, target_step: int = 0) -> None:
    buffer.reserve(group_id, keys(group_id), target_step, version)
    buffer.commit(group_id, keys(group_id), (0.0, 1.0), version)


def progress(trainer_version=0, batch_index=0, consumed_in_step=0, finished_steps=0) -> TrainProgress:
    return TrainProgress(trainer_version, batch_index, consumed_in_step, finished_steps)


# -- buffer ----------------------------------------------------------------------------


def test_capacity_counts_reserved_ready_and_consumed_groups():
    buffer = ReplayBuffer(capacity=3)
    buffer.reserve(0, keys(0), 0, 0)
    ready(buffer, 1, 0)
    ready(buffer, 2, 0)
    buffer.consume(2)
    assert not buffer.has_room
    assert buffer.describe() == "3/3 groups: 1 reserved, 1 ready, 1 consumed by the open step"
    assert buffer.outstanding == 2
    with pytest.raises(SlotError, match="buffer full"):
        buffer.reserve(3, keys(3), 0, 0)
    buffer.release(2)  # the step's clear frees the consumed group's slot
    assert buffer.has_room and buffer.count(GroupState.CONSUMED) == 0


def test_commit_records_arrival_order_and_the_generation_version():
    buffer = ReplayBuffer(capacity=4)
    for group_id in (5, 3, 9):
        buffer.reserve(group_id, keys(group_id), 0, version=0)
    buffer.commit(9, keys(9)[:1], (1.0,), version=2)  # one sample failed its reward
    buffer.commit(3, keys(3), (0.0, 1.0), version=0)
    assert sorted((g.group_id, g.arrival) for g in buffer.groups(GroupState.READY)) == [(3, 1), (9, 0)]
    assert buffer.get(9).version == 2 and buffer.get(9).keys == keys(9)[:1]
    assert buffer.get(5).state is GroupState.RESERVED


def test_slot_misuse_raises():
    buffer = ReplayBuffer(capacity=2)
    buffer.reserve(0, keys(0), 0, 0)
    with pytest.raises(SlotError, match="already"):
        buffer.reserve(0, keys(0), 0, 0)
    with pytest.raises(SlotError, match="reserved, expected ready"):
        buffer.consume(0)
    with pytest.raises(SlotError, match="not in the buffer"):
        buffer.commit(1, keys(1), (), 0)
    with pytest.raises(SlotError, match="unknown group"):
        buffer.release(7)
    with pytest.raises(ValueError):
        ReplayBuffer(0)


# -- sampler: train side -------------------------------------------------------------------


def test_select_orders_by_lag_then_arrival():
    buffer = ReplayBuffer(capacity=8)
    ready(buffer, 0, version=1)
    ready(buffer, 1, version=2)
    ready(buffer, 2, version=2)
    sampler = StalenessSampler(settings(max_lag=1))
    picked = []
    while (group := sampler.select(buffer, trainer_version=2, batch_index=2, open_slots=2)) is not None:
        picked.append(group.group_id)
        buffer.consume(group.group_id)
    assert picked == [1, 2, 0]


def test_strict_on_policy_filter_and_eviction():
    buffer = ReplayBuffer(capacity=8)
    ready(buffer, 0, version=2)
    ready(buffer, 1, version=3)
    sampler = StalenessSampler(settings(max_lag=0))
    assert sampler.select(buffer, 3, 3, 2).group_id == 1
    assert sampler.count_eligible(buffer, 3, 3) == 1
    assert [g.group_id for g in sampler.evict(buffer, trainer_version=3)] == [0]


def test_in_order_takes_only_the_groups_planned_for_the_step():
    buffer = ReplayBuffer(capacity=8)
    ready(buffer, 2, version=0, target_step=1)
    sampler = StalenessSampler(settings(order="in_order"))
    assert sampler.select(buffer, 0, batch_index=0, open_slots=2) is None
    ready(buffer, 0, version=0, target_step=0)
    assert sampler.select(buffer, 0, batch_index=0, open_slots=2).group_id == 0
    assert sampler.describe_wait(0, 0) == "groups planned for step 0 (in order) at version 0"


def test_a_fresh_group_never_pushes_a_ready_one_past_its_deadline():
    # step 1 has one slot left: ready group 0 (version 0) expires unless it takes it
    buffer = ReplayBuffer(capacity=8)
    ready(buffer, 0, version=0)
    ready(buffer, 1, version=1)
    sampler = StalenessSampler(settings(too_stale="drop"))
    assert sampler.select(buffer, 1, 1, open_slots=1).group_id == 0
    assert sampler.select(buffer, 1, 1, open_slots=2).group_id == 1  # room for both: freshest first


def test_when_something_must_expire_the_oldest_ready_group_goes_first():
    buffer = ReplayBuffer(capacity=8)
    for group_id in range(3):
        ready(buffer, group_id, version=0)
    ready(buffer, 3, version=1)
    sampler = StalenessSampler(settings(too_stale="wait"))
    assert sampler.select(buffer, 1, 1, open_slots=2).group_id == 0


def test_wait_mode_keeps_a_fresh_group_from_expiring_an_old_one():
    # step 1 has one slot left; group 0 (version 0) must train in it or expire
    buffer = ReplayBuffer(capacity=8)
    buffer.reserve(0, keys(0), 1, version=0)
    ready(buffer, 1, version=1)
    drop = StalenessSampler(settings(too_stale="drop"))
    wait = StalenessSampler(settings(too_stale="wait"))
    assert drop.select(buffer, 1, 1, open_slots=1).group_id == 1
    assert wait.select(buffer, 1, 1, open_slots=1) is None
    assert wait.select(buffer, 1, 1, open_slots=2).group_id == 1  # room for both
    buffer.commit(0, keys(0), (1.0, 0.0), version=0)
    assert wait.select(buffer, 1, 1, open_slots=1).group_id == 0


# -- sampler: the dispatch quota ---------------------------------------------------------------


def test_quota_dispatches_one_window_ahead_of_the_generator():
    sampler = StalenessSampler(settings(max_lag=1, prompts_per_step=2))
    buffer = ReplayBuffer(capacity=16)
    planned = []
    while (plan := sampler.plan_dispatch(buffer, progress(), generator_version=0, groups_dispatched=0)).blocked is None:
        planned.append(plan.train_version)
        buffer.reserve(len(planned), keys(len(planned)), plan.target_step, 0)
    assert planned == [0, 0, 1, 1]
    assert "lag 2 > max_lag 1" in plan.blocked
    # the open step's consumed groups still count against the window
    buffer.release(1)
    buffer.release(2)
    assert sampler.plan_dispatch(buffer, progress(consumed_in_step=2), 0, 0).blocked is not None
    # once step 0 finished and version 1 reached the generator, one more step opens up
    assert sampler.plan_dispatch(buffer, progress(1, 1, finished_steps=1), 0, 0).blocked is not None
    assert sampler.plan_dispatch(buffer, progress(1, 1, finished_steps=1), 1, 0).train_version == 2


def test_quota_with_max_lag_zero_waits_for_the_weight_sync():
    sampler = StalenessSampler(settings(max_lag=0, prompts_per_step=2))
    buffer = ReplayBuffer(capacity=16)
    open_step = progress(trainer_version=3, batch_index=3, consumed_in_step=2, finished_steps=3)
    plan = sampler.plan_dispatch(buffer, open_step, generator_version=3, groups_dispatched=0)
    assert plan.blocked.startswith("staleness bound")  # the open step is full
    after_finish = progress(trainer_version=4, batch_index=4, finished_steps=4)
    assert sampler.plan_dispatch(buffer, after_finish, 3, 0).blocked is not None  # generator still at 3
    assert sampler.plan_dispatch(buffer, after_finish, 4, 0).blocked is None


def test_quota_stops_when_the_remaining_steps_are_covered():
    sampler = StalenessSampler(settings(max_lag=5, prompts_per_step=2, steps=2))
    buffer = ReplayBuffer(capacity=16)
    for group_id in range(4):
        buffer.reserve(group_id, keys(group_id), 0, 0)
    plan = sampler.plan_dispatch(buffer, progress(), 0, 4)
    assert plan.blocked == "enough groups dispatched for the remaining 2 steps"


def test_in_order_targets_follow_prompt_order():
    sampler = StalenessSampler(settings(order="in_order", max_lag=1, prompts_per_step=2))
    buffer = ReplayBuffer(capacity=16)
    targets = [sampler.plan_dispatch(buffer, progress(), 0, n).target_step for n in range(4)]
    assert targets == [0, 0, 1, 1]
    assert sampler.plan_dispatch(buffer, progress(), 0, 4).blocked is not None  # step 2 would be lag 2
    # after an abort the batch index stays, so the same targets train one version later at most
    assert sampler.plan_dispatch(buffer, progress(1, 1, finished_steps=1), 1, 4).train_version == 2


def test_max_ahead_lets_whole_groups_past_the_step_the_generator_trains_fresh():
    """verl's staleness_threshold = 0.5 of 4 prompts per step: 2 groups ahead, not the max_lag step's 4."""
    sampler = StalenessSampler(settings(max_lag=1, max_ahead=0.5, prompts_per_step=4))
    buffer = ReplayBuffer(capacity=16)
    planned = []
    while (plan := sampler.plan_dispatch(buffer, progress(), generator_version=0, groups_dispatched=0)).blocked is None:
        planned.append(plan.train_version)
        buffer.reserve(len(planned), keys(len(planned)), plan.target_step, 0)
    assert planned == [0, 0, 0, 0, 1, 1]
    assert "3 groups generated with weights version 0 or older would train at a later version" in plan.blocked
    assert "max_ahead 0.5 x 4 prompts per step allows 2" in plan.blocked
    # the trainer moved on to version 1 but the generator still holds 0: everything it makes now is stale
    moved_on = progress(1, 1, finished_steps=1)
    for group_id in (1, 2, 3, 4):
        buffer.release(group_id)
    assert sampler.plan_dispatch(buffer, moved_on, 0, 0).blocked is not None  # 2 stale already outstanding
    assert sampler.plan_dispatch(buffer, moved_on, 1, 0).blocked is None  # version 1 arrived: fresh again


def test_max_ahead_in_order_counts_positions_in_prompt_order():
    sampler = StalenessSampler(settings(order="in_order", max_lag=2, max_ahead=1.5, prompts_per_step=2))
    buffer = ReplayBuffer(capacity=16)
    plans = [sampler.plan_dispatch(buffer, progress(), 0, n) for n in range(6)]
    assert [p.blocked is None for p in plans] == [True] * 5 + [False]  # the open step, then 3 groups ahead
    assert [p.target_step for p in plans[:5]] == [0, 0, 1, 1, 2]


def test_max_ahead_unset_or_equal_to_max_lag_is_the_lag_bound():
    buffer = ReplayBuffer(capacity=32)
    for group_id in range(5):
        buffer.reserve(group_id, keys(group_id), 0, 0)
    unset, equal = (StalenessSampler(settings(max_lag=2, prompts_per_step=2, max_ahead=a)) for a in (None, 2.0))
    for trainer, generator, consumed in [(0, 0, 0), (0, 0, 1), (1, 0, 0), (2, 1, 1), (3, 1, 0)]:
        at = progress(trainer, trainer, consumed, trainer)
        assert (unset.plan_dispatch(buffer, at, generator, 0).blocked is None) == \
            (equal.plan_dispatch(buffer, at, generator, 0).blocked is None)


def test_max_ahead_beyond_max_lag_is_refused_by_the_settings():
    with pytest.raises(ValueError, match="max_ahead must be between 0 and max_lag 1"):
        settings(max_lag=1, max_ahead=1.5)
