"""The controller's pumps end to end on sim engines, in one process.

Covers the streaming scenarios of the split-step train pump (arrival order,
version ticks only at finish, strict on-policy, long-tail overlap, abort,
empty step, one clear per step), the staleness bound and the ledger under
random latencies and failures, and the watchdog.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from rldsl.runtime.control.advantages import group_advantages
from rldsl.runtime.control.controller import Controller, PipelineStalled, StageHandles, StepFailed
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.dataplane import InMemoryDataPlane, parse_sample_key
from rldsl.runtime.engines.sim import Latency, SimTrainer, SplitStepError
from rldsl.runtime.inprocess import SimConfig, SimStages
from rldsl.runtime.protocols import FIELD_ADVANTAGE, Prompt


class RecordingDataPlane(InMemoryDataPlane):
    def __init__(self) -> None:
        super().__init__()
        self.clears: list[list[str]] = []

    def clear(self, keys, partition):
        self.clears.append(list(keys))
        super().clear(keys, partition)


def make_settings(**overrides) -> RunSettings:
    values = dict(
        pipeline="t",
        prompts_per_step=2,
        samples_per_prompt=2,
        steps=3,
        max_lag=1,
        reward_stages=("score",),
        logprob_stages=("reference",),
        watchdog_timeout_s=5.0,
    )
    values.update(overrides)
    return RunSettings(**values)


def prompt_stream(count: int | None = None):
    indices = itertools.count() if count is None else range(count)
    return (Prompt(i, f"question {i}", "answer") for i in indices)


def run_controller(settings, config=SimConfig(), *, wrap=None, prompts=None, on_step=None):
    """Run to the end; returns (summary, sim engines, data plane)."""
    dataplane = RecordingDataPlane()
    sim = SimStages(settings, dataplane, config)
    handles = wrap(sim.handles) if wrap else sim.handles
    controller = Controller(settings, handles, dataplane, prompts or prompt_stream(), on_step=on_step)
    summary = asyncio.run(controller.run())
    return summary, sim, dataplane


def timed(intervals: list, name: str, fn, replica_arg: int | None = None):
    """``fn`` recording (name, replica or None, start, end) of every call into ``intervals``."""
    async def call(*args):
        start = time.monotonic()
        try:
            return await fn(*args)
        finally:
            replica = args[replica_arg] if replica_arg is not None else None
            intervals.append((name, replica, start, time.monotonic()))
    return call


def group_of(key: str) -> int:
    return parse_sample_key(key)[1]


def trainer_calls(sim: SimStages, name: str) -> list[tuple[str, int, int]]:
    return [call for call in sim.trainer.calls if call[0] == name]


# -- the seed-001 streaming scenarios ------------------------------------------


def test_microbatches_follow_arrival_order():
    settings = make_settings(prompts_per_step=4, max_lag=0, steps=3)
    arrivals: list[int] = []

    def wrap(handles: StageHandles) -> StageHandles:
        async def logprob(stage, keys):  # the last stage: the group commits right after
            await handles.logprob(stage, keys)
            arrivals.append(group_of(keys[0]))

        return dataclasses.replace(handles, logprob=logprob)

    config = SimConfig(generate=Latency.uniform(0.001, 0.02), generators=4, microbatch=Latency.constant(0.003))
    summary, sim, _ = run_controller(settings, config, wrap=wrap)
    trained = [group_of(keys[0]) for _, keys, _ in sim.microbatch_keys]
    assert summary["steps"] == 3
    assert sorted(trained) == sorted(arrivals)
    for step in range(3):
        in_step = [group_of(keys[0]) for s, keys, _ in sim.microbatch_keys if s == step]
        assert in_step == [g for g in arrivals if g in in_step]


def test_version_ticks_only_at_finish():
    settings = make_settings(prompts_per_step=3, steps=4)
    dataplane = RecordingDataPlane()
    sim = SimStages(settings, dataplane, SimConfig(generate=Latency.uniform(0.001, 0.005)))
    seen: list[tuple[str, int, int]] = []  # (call, trainer version before, after)

    def observe(name, call):
        async def observed(*args):
            before = sim.trainer.version
            result = await call(*args)
            seen.append((name, before, sim.trainer.version))
            return result

        return observed

    handles = dataclasses.replace(
        sim.handles,
        begin_train_step=observe("begin", sim.handles.begin_train_step),
        train_microbatch=observe("microbatch", sim.handles.train_microbatch),
        finish_train_step=observe("finish", sim.handles.finish_train_step),
    )
    asyncio.run(Controller(settings, handles, dataplane, prompt_stream()).run())
    for name, before, after in seen:
        assert after == before + (name == "finish")
    assert [after for name, _, after in seen if name == "finish"] == [1, 2, 3, 4]


def test_strict_on_policy_trains_only_lag_zero():
    settings = make_settings(prompts_per_step=3, max_lag=0, steps=4, buffer_capacity=12, max_inflight=6)
    config = SimConfig(generate=Latency.uniform(0.001, 0.01), generators=3, finish=Latency.constant(0.01))
    summary, _, _ = run_controller(settings, config)
    assert summary["ledger"]["lag_histogram"] == {0: 4 * 3 * 2}
    assert summary["ledger"]["dropped"] == {}


def test_long_tail_group_does_not_block_other_groups():
    settings = make_settings(prompts_per_step=4, max_lag=1, steps=3)
    finished_at: dict[str, float] = {}
    committed_at: dict[int, float] = {}

    def wrap(handles: StageHandles) -> StageHandles:
        async def generate(replica, prompts, keys, samples_per_prompt, seed):
            if prompts[0].index == 0:
                await asyncio.sleep(0.3)  # the straggler
            generated = await handles.generate(replica, prompts, keys, samples_per_prompt, seed)
            committed_at[prompts[0].index] = time.monotonic()
            return generated

        async def finish(step):
            result = await handles.finish_train_step(step)
            finished_at.setdefault(f"step{step}", time.monotonic())
            return result

        return dataclasses.replace(handles, generate=generate, finish_train_step=finish)

    config = SimConfig(generate=Latency.constant(0.005), generators=4, microbatch=Latency.constant(0.002))
    summary, sim, _ = run_controller(settings, config, wrap=wrap)
    step0 = [group_of(keys[0]) for step, keys, _ in sim.microbatch_keys if step == 0]
    assert 0 not in step0 and len(step0) == 4
    assert finished_at["step0"] < committed_at[0]  # step 0 finished while the straggler generated
    assert summary["max_lag"] <= 1
    assert summary["ledger"]["generated"] == summary["ledger"]["trained"] + sum(summary["ledger"]["dropped"].values())


@pytest.mark.parametrize("too_stale", ["drop", "wait"])
def test_a_straggler_past_its_deadline_is_dropped_or_waited_for(too_stale):
    # max_lag 1: prompt 0 (version 0) must train by step 1, but its reward takes 0.3 s
    # (a generation straggler would also hold the weight push, which waits for generators to be idle)
    settings = make_settings(prompts_per_step=2, max_lag=1, steps=3, too_stale=too_stale)

    def wrap(handles: StageHandles) -> StageHandles:
        async def reward(stage, keys):
            if group_of(keys[0]) == 0:
                await asyncio.sleep(0.3)
            return await handles.reward(stage, keys)

        return dataclasses.replace(handles, reward=reward)

    config = SimConfig(generate=Latency.constant(0.005), generators=4, reward_workers=4)
    summary, sim, _ = run_controller(settings, config, wrap=wrap)
    step1 = {group_of(keys[0]) for step, keys, _ in sim.microbatch_keys if step == 1}
    if too_stale == "drop":  # the trainer went on with a fresh group; the straggler expired
        assert summary["ledger"]["dropped"] == {"too_stale": 2} and 0 not in step1
    else:  # the trainer waited for it
        assert summary["ledger"]["dropped"] == {} and 0 in step1
    assert summary["max_lag"] == 1


def test_abort_drops_the_step_and_the_run_recovers():
    settings = make_settings(prompts_per_step=2, steps=3)
    config = SimConfig(trainer_fail_on=(("finish_train_step", 1),), generate=Latency.constant(0.002))
    summary, sim, dataplane = run_controller(settings, config)
    assert summary["steps"] == 3 and summary["aborted_steps"] == 1
    assert summary["ledger"]["dropped"] == {"step_aborted": 2 * 2}
    assert [c[1] for c in trainer_calls(sim, "abort_train_step")] == [1]
    # the retried step 1 begins again after the abort and finishes
    assert [c[1] for c in trainer_calls(sim, "finish_train_step")] == [0, 1, 1, 2]
    assert sim.trainer.version == 3
    assert dataplane.list("t") == []


def test_request_stop_ends_the_run_after_the_call_in_flight_with_the_ledger_balanced():
    """Ctrl-C's path: a stop during a step's first microbatch lets that call
    complete, aborts the step and returns a summary; every generated sample
    is trained or dropped, none twice."""
    settings = make_settings(prompts_per_step=4, steps=50)
    config = SimConfig(generate=Latency.constant(0.002), microbatch=Latency.constant(0.005))
    dataplane = RecordingDataPlane()
    sim = SimStages(settings, dataplane, config)
    controller = None

    async def stop_during_step_2(step, keys, replica):
        if step == 2:
            controller.request_stop()
        return await sim.handles.train_microbatch(step, keys, replica)

    handles = dataclasses.replace(sim.handles, train_microbatch=stop_during_step_2)
    controller = Controller(settings, handles, dataplane, prompt_stream())
    summary = asyncio.run(controller.run())  # the ledger check runs inside
    assert summary["steps"] == summary["version"] == sim.trainer.version == 2
    assert [c[1] for c in trainer_calls(sim, "abort_train_step")] == [2]
    assert sim.trainer.open_step is None  # nothing half-trained is left open
    ledger = summary["ledger"]
    assert ledger["trained"] == 2 * 4 * 2
    # the group of step 2 in its microbatch when the stop came, and any taken into step 2 behind it
    assert ledger["dropped"]["run_stopped"] >= 2
    assert [step for step, _, _ in sim.microbatch_keys].count(2) == 1  # queued microbatches never started
    assert set(ledger["dropped"]) <= {"run_stopped", "run_finished"}
    assert dataplane.list("t") == []


def test_abort_is_idempotent():
    trainer = SimTrainer()
    trainer.abort_train_step(0)  # nothing open: a no-op
    trainer.begin_train_step(0)
    trainer.abort_train_step(0)
    trainer.abort_train_step(0)
    trainer.begin_train_step(0)  # the step can be opened again
    assert trainer.version == 0 and trainer.open_step == 0


def test_split_step_protocol_violations_raise():
    trainer = SimTrainer()
    batch = {"response_mask": [[1]], FIELD_ADVANTAGE: [0.0]}
    with pytest.raises(SplitStepError, match="no open step"):
        trainer.train_microbatch(0, batch)
    with pytest.raises(SplitStepError, match="no open step"):
        trainer.finish_train_step(0)
    trainer.begin_train_step(0)
    with pytest.raises(SplitStepError, match="while step 0 is open"):
        trainer.begin_train_step(1)
    with pytest.raises(SplitStepError, match="open step is 0"):
        trainer.train_microbatch(1, batch)
    with pytest.raises(SplitStepError, match="advantage"):
        trainer.train_microbatch(0, {"response_mask": [[1]]})


def test_exhausted_prompts_make_an_empty_step_a_no_op():
    settings = make_settings(steps=3)
    summary, sim, dataplane = run_controller(settings, prompts=prompt_stream(0))
    assert summary["steps"] == 0 and sim.trainer.calls == [] and dataplane.clears == []
    assert summary["ledger"]["generated"] == 0


def test_in_order_batch_with_every_reward_failed_is_skipped():
    settings = make_settings(prompts_per_step=2, steps=2, order="in_order")

    def wrap(handles: StageHandles) -> StageHandles:
        async def reward(stage, keys):
            if group_of(keys[0]) in (2, 3):  # batch 1's groups
                return [None] * len(keys)
            return await handles.reward(stage, keys)

        return dataclasses.replace(handles, reward=reward)

    summary, sim, _ = run_controller(settings, SimConfig(generate=Latency.constant(0.002)), wrap=wrap)
    assert summary["steps"] == 2
    assert [c[1] for c in trainer_calls(sim, "begin_train_step")] == [0, 2]  # batch 1 never opened
    assert summary["ledger"]["dropped"] == {"reward_failed": 4}
    assert sorted({group_of(k[0]) for _, k, _ in sim.microbatch_keys}) == [0, 1, 4, 5]


def test_exactly_one_clear_per_step():
    settings = make_settings(prompts_per_step=3, steps=4)
    summary, sim, dataplane = run_controller(settings, SimConfig(generate=Latency.uniform(0.001, 0.004)))
    assert summary["ledger"]["dropped"] == {}
    assert len(dataplane.clears) == 4 == len(trainer_calls(sim, "finish_train_step"))
    for step, cleared in enumerate(dataplane.clears):
        trained = [key for s, keys, _ in sim.microbatch_keys if s == step for key in keys]
        assert sorted(cleared) == sorted(trained)
    assert dataplane.list("t") == []


def test_advantages_are_written_before_each_microbatch():
    settings = make_settings(samples_per_prompt=4, steps=2)
    dataplane = RecordingDataPlane()
    sim = SimStages(settings, dataplane, SimConfig())
    seen: list[list[float]] = []

    async def microbatch(step, keys, replica):
        fields = dataplane.get(list(keys), "t", [FIELD_ADVANTAGE, "reward"])
        expected = group_advantages(fields["reward"].tolist(), settings.advantage_eps)
        assert fields[FIELD_ADVANTAGE].tolist() == pytest.approx(expected, abs=1e-6)
        seen.append(fields[FIELD_ADVANTAGE].tolist())
        return await sim.train_microbatch(step, keys, replica)

    handles = dataclasses.replace(sim.handles, train_microbatch=microbatch)
    asyncio.run(Controller(settings, handles, dataplane, prompt_stream()).run())
    assert len(seen) == 4


def test_metrics_callback_reports_every_step():
    records: list[dict] = []
    summary, _, _ = run_controller(make_settings(steps=3), on_step=records.append)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["version"] for r in records] == [1, 2, 3]
    assert all(r["samples"] == 4 and sum(r["lag_histogram"].values()) == 4 for r in records)
    assert {"generate", "train", "reward:score", "logprob:reference"} <= set(records[-1]["busy"])
    assert summary["weight_pushes"] == 3 and summary["samples_per_s"] > 0


def test_a_slow_weight_push_holds_neither_generation_nor_the_trainer():
    settings = make_settings(prompts_per_step=2, max_lag=2, steps=4)
    config = SimConfig(generate=Latency.constant(0.001), push_bucket=Latency.constant(0.03), generators=2)
    intervals = []

    def wrap(handles: StageHandles) -> StageHandles:
        return dataclasses.replace(handles, generate=timed(intervals, "generate", handles.generate),
                                   push_weights=timed(intervals, "push", handles.push_weights),
                                   finish_train_step=timed(intervals, "finish", handles.finish_train_step))

    summary, sim, _ = run_controller(settings, config, wrap=wrap)
    assert summary["steps"] == 4 and summary["aborted_steps"] == 0
    assert summary["weight_pushes"] >= 2
    pushes = [(s, e) for name, _, s, e in intervals if name == "push"]
    others = [(s, e) for name, _, s, e in intervals if name != "push"]
    assert any(s < pe and ps < e for ps, pe in pushes for s, e in others), "nothing ran during a push"


# -- properties: the staleness bound and the ledger ------------------------------

latencies = st.builds(Latency.uniform, st.floats(0, 0.002), st.floats(0, 0.004))


@hyp_settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_lag=st.integers(0, 2),
    prompts_per_step=st.integers(1, 3),
    extra_capacity=st.integers(0, 6),
    inflight=st.integers(1, 8),
    order=st.sampled_from(["any", "in_order"]),
    too_stale=st.sampled_from(["drop", "wait"]),
    generators=st.integers(1, 3),
    generate=latencies,
    reward=latencies,
    train=latencies,
    seed=st.integers(0, 1000),
)
def test_staleness_bound_holds_and_ledger_balances(
    max_lag, prompts_per_step, extra_capacity, inflight, order, too_stale, generators, generate, reward, train, seed
):
    settings = make_settings(
        max_lag=max_lag,
        prompts_per_step=prompts_per_step,
        buffer_capacity=prompts_per_step + extra_capacity,
        max_inflight=inflight,
        order=order,
        too_stale=too_stale,
        steps=3,
        seed=seed,
    )
    config = SimConfig(generate=generate, reward=reward, microbatch=train, generators=generators, reward_workers=2)
    summary, _, dataplane = run_controller(settings, config)  # run() checks the ledger
    ledger = summary["ledger"]
    assert summary["steps"] == 3
    assert max(ledger["lag_histogram"]) <= max_lag
    assert ledger["generated"] == ledger["trained"] + sum(ledger["dropped"].values())
    if too_stale == "wait" or order == "in_order":
        assert "too_stale" not in ledger["dropped"]
    assert dataplane.list("t") == []


@pytest.mark.parametrize("order", ["any", "in_order"])
@pytest.mark.parametrize("seed", range(3))
def test_ledger_balances_under_failing_workers_and_trainer(seed, order):
    settings = make_settings(
        prompts_per_step=3, samples_per_prompt=3, steps=5, seed=seed, order=order, max_aborted_steps=20
    )
    config = SimConfig(
        generate=Latency.uniform(0.0, 0.003),
        reward=Latency.uniform(0.0, 0.002),
        generators=2,
        reward_workers=2,
        reward_fail_prob=0.2,
        reward_call_fail_prob=0.1,
        generate_fail_prob=0.1,
        trainer_fail_prob=0.1,
        trainer_fail_on=(("finish_train_step", 2),),
    )
    summary, _, dataplane = run_controller(settings, config)
    ledger = summary["ledger"]
    assert summary["steps"] == 5 and summary["aborted_steps"] >= 1
    assert {"reward_failed", "step_aborted"} <= set(ledger["dropped"])
    assert ledger["generated"] == ledger["trained"] + sum(ledger["dropped"].values())
    assert max(ledger["lag_histogram"]) <= settings.max_lag
    assert dataplane.list("t") == []


def test_too_many_consecutive_aborts_fail_the_run():
    settings = make_settings(max_aborted_steps=2)
    with pytest.raises(StepFailed, match="2 consecutive train steps aborted"):
        run_controller(settings, SimConfig(trainer_fail_prob=1.0))


# -- the watchdog -------------------------------------------------------------------


def test_watchdog_names_the_buffer_when_it_cannot_hold_a_step():
    # capacity 3 < 4 prompts per step: the compiler rejects this, forced here
    settings = make_settings(prompts_per_step=4, buffer_capacity=3, watchdog_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(PipelineStalled) as stalled:
        run_controller(settings)
    assert time.monotonic() - started < 3
    message = str(stalled.value)
    assert "rollout pump: buffer full (3/3 groups: 0 reserved, 0 ready, 3 consumed by the open step)" in message
    assert "train pump: step 0 has 3/4 groups; waiting for 1 more ready groups with lag <= 1 at version 0" in message
    assert "sync pump: idle" in message


def test_watchdog_reports_generation_that_always_fails():
    settings = make_settings(watchdog_timeout_s=0.3)
    with pytest.raises(PipelineStalled, match=r"last failure generation_failed: SimFailure"):
        run_controller(settings, SimConfig(generate_fail_prob=1.0))


@pytest.mark.parametrize("handle,report", [
    ("reward", r"groups in flight"),
    ("train_microbatch", r"train pump: step 0: .*in train_microbatch on trainer replicas \[0\]"),
])
def test_watchdog_reports_a_call_that_never_returns(handle, report):
    settings = make_settings(watchdog_timeout_s=0.3)

    def wrap(handles: StageHandles) -> StageHandles:
        async def hang(*args):
            await asyncio.Event().wait()

        return dataclasses.replace(handles, **{handle: hang})

    with pytest.raises(PipelineStalled, match=report):
        run_controller(settings, wrap=wrap)


# -- settings and advantages ----------------------------------------------------------


def test_settings_default_to_one_staleness_window():
    settings = make_settings(prompts_per_step=8, max_lag=2)
    assert settings.buffer_capacity == 24 and settings.max_inflight == 24
    with pytest.raises(ValueError, match="order"):
        make_settings(order="fifo")
    with pytest.raises(ValueError, match="max_lag"):
        make_settings(max_lag=-1)


def test_group_advantages():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([2.0]) == [0.0]
    values = group_advantages([0.0, 1.0], eps=0.0)
    assert values == pytest.approx([-0.7071068, 0.7071068])
    assert sum(group_advantages([0.0, 3.0, 1.0, 1.0])) == pytest.approx(0.0)


def test_a_trainer_rank_lost_during_the_weight_export_ends_the_run_as_a_lost_trainer():
    """Every trainer call names a lost rank the same way, the export too, so
    the run restarts from its last checkpoint instead of failing unnamed."""
    from rldsl.runtime.control.errors import TrainerLost, WorkerLost

    def wrap(handles: StageHandles) -> StageHandles:
        async def export_weights(version):
            raise WorkerLost("actor", 0, "ActorDiedError: killed")

        return dataclasses.replace(handles, export_weights=export_weights)

    with pytest.raises(TrainerLost, match="trainer rank 0 of `actor` died during export_weights"):
        run_controller(make_settings(), wrap=wrap)


def test_a_step_that_took_no_optimizer_step_journals_its_samples_as_skipped_not_trained():
    def wrap(handles):
        async def finish(step):
            result = await handles.finish_train_step(step)
            return dataclasses.replace(result, metrics={**result.metrics, "skipped": 1.0}) if step == 1 else result

        return dataclasses.replace(handles, finish_train_step=finish)

    records: list[dict] = []
    summary, _, _ = run_controller(make_settings(steps=3), wrap=wrap, on_step=records.append)
    ledger = summary["ledger"]
    assert ledger["dropped"].get("step_skipped") == 4 and ledger["trained"] == 8
    assert [r["samples"] for r in records] == [4, 0, 4]
