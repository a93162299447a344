"""Every replica busy, in process on sim engines: data-parallel lanes,
batched generation, pushes that do not stop generation, partial overlap.

The sim stages check the engines' invariants as the run goes (a trainer
replica never runs two microbatches at once, no trainer call while a
replica on the trainer's GPUs is awake, weights swap only between batches)
and raise, which would abort steps: every test here expects none."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from rldsl.runtime.control.controller import StageHandles
from rldsl.runtime.control.lanes import MicrobatchLanes
from rldsl.runtime.engines.sim import Latency
from rldsl.runtime.inprocess import SimConfig
from tests.test_controller import group_of, make_settings, run_controller, timed


def balanced_ledger(summary: dict) -> None:
    ledger = summary["ledger"]
    assert ledger["open"] == 0
    assert ledger["generated"] == ledger["trained"] + sum(ledger["dropped"].values())


@pytest.mark.parametrize("dp", [2, 4])
def test_every_trainer_replica_has_microbatches_in_flight_at_once(dp):
    settings = make_settings(prompts_per_step=8, samples_per_prompt=2, steps=3, max_lag=1)
    config = SimConfig(generate=Latency.constant(0.001), generators=2, microbatch=Latency.constant(0.02),
                       train_replicas=dp)
    intervals: list = []

    def wrap(handles: StageHandles) -> StageHandles:
        return dataclasses.replace(handles, train_microbatch=timed(intervals, "mb", handles.train_microbatch, 2))

    summary, sim, _ = run_controller(settings, config, wrap=wrap)
    assert summary["steps"] == 3 and summary["aborted_steps"] == 0
    balanced_ledger(summary)
    for step in range(3):  # equal counts per rank, every step
        per_rank = Counter(replica for s, _, replica in sim.microbatch_keys if s == step)
        assert sorted(per_rank.values()) == [8 // dp] * dp
    for replica in range(dp):  # one rank never runs two microbatches at once
        spans = sorted((s, e) for _, r, s, e in intervals if r == replica)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    overlapping = [(a, b) for a in intervals for b in intervals if a[1] != b[1] and a[2] < b[3] and b[2] < a[3]]
    assert overlapping, "no two ranks ever trained at the same time"


def test_data_parallel_shares_are_balanced_by_tokens():
    settings = make_settings(prompts_per_step=8, samples_per_prompt=4, steps=4, max_lag=1)
    config = SimConfig(generate=Latency.constant(0.001), generators=2, train_replicas=2, max_new_tokens=32)
    tokens: dict[int, int] = {}

    def wrap(handles: StageHandles) -> StageHandles:
        async def generate(replica, prompts, keys, samples_per_prompt, seed):
            generated = await handles.generate(replica, prompts, keys, samples_per_prompt, seed)
            tokens[prompts[0].index] = generated.tokens
            return generated
        return dataclasses.replace(handles, generate=generate)

    summary, sim, _ = run_controller(settings, config, wrap=wrap)
    assert summary["steps"] == 4
    for step in range(4):
        loads = Counter()
        for s, keys, replica in sim.microbatch_keys:
            if s == step:
                loads[replica] += tokens[group_of(keys[0])]
        assert abs(loads[0] - loads[1]) <= 2 * max(tokens.values())


def test_lanes_give_each_rank_its_share_and_the_lightest_rank_the_next_group():
    lanes = MicrobatchLanes(2, lambda: None)
    lanes.open_step(4)
    assert [lanes.assign(tokens) for tokens in (100, 10, 90, 20)] == [0, 1, 1, 0]
    assert lanes.counts == [2, 2] and lanes.tokens == [120, 100]  # round robin would give 190 / 30
    lanes.open_step(3)  # a share that does not divide: the first ranks take one more
    assert sorted(lanes.assign(1) for _ in range(3)) == [0, 0, 1]


def test_a_replica_decodes_the_groups_queued_on_it_in_one_batch():
    settings = make_settings(prompts_per_step=8, samples_per_prompt=2, steps=3, max_lag=1)
    config = SimConfig(generate=Latency.constant(0.02), generate_per_group=0.002, generators=1)
    summary, sim, _ = run_controller(settings, config)
    assert summary["steps"] == 3
    replica = sim.replicas[0]
    assert replica.max_groups >= 4  # a step's worth queued at once
    assert replica.batches < summary["ledger"]["generated"] // 2  # fewer calls than groups


def test_weights_swap_between_batches_and_each_group_has_one_version():
    settings = make_settings(prompts_per_step=4, samples_per_prompt=2, steps=6, max_lag=1)
    config = SimConfig(generate=Latency.constant(0.01), generators=2, push_bucket=Latency.constant(0.01),
                       microbatch=Latency.constant(0.002))
    summary, sim, dataplane = run_controller(settings, config)
    assert summary["steps"] == 6 and summary["aborted_steps"] == 0
    assert summary["weight_pushes"] >= 3
    assert summary["max_lag"] <= 1
    assert min(g.version for g in sim.generators) >= summary["version"] - 1


def test_partial_overlap_sleeps_only_the_replica_on_the_trainer_gpus():
    settings = make_settings(prompts_per_step=4, samples_per_prompt=2, steps=4, max_lag=1, sleeping_replicas=(0,))
    config = SimConfig(generate=Latency.constant(0.02), microbatch=Latency.constant(0.01),
                       finish=Latency.constant(0.02), generators=2)
    intervals: list = []
    slept: list = []

    def wrap(handles: StageHandles) -> StageHandles:
        async def sleep(replicas):
            slept.append(tuple(replicas))
            await handles.sleep_generators(replicas)
        return dataclasses.replace(
            handles, generate=timed(intervals, "generate", handles.generate, 0),
            train_microbatch=timed(intervals, "train", handles.train_microbatch),
            finish_train_step=timed(intervals, "train", handles.finish_train_step),
            sleep_generators=sleep)

    summary, sim, _ = run_controller(settings, config, wrap=wrap)
    assert summary["steps"] == 4 and summary["aborted_steps"] == 0  # no trainer call ran beside replica 0 awake
    balanced_ledger(summary)
    assert slept == [(0,)] * 4
    train = [(s, e) for name, _, s, e in intervals if name == "train"]
    for name, replica, gs, ge in intervals:
        if name == "generate" and replica == 0:
            assert all(ge <= ts or te <= gs for ts, te in train), "replica 0 generated while the trainer ran"
    assert any(name == "generate" and replica == 1 and gs < te and ts < ge
               for name, replica, gs, ge in intervals for ts, te in train), "replica 1 never generated during a step"
    assert sim.generators[0].version == summary["version"]  # refreshed from the host cache when it woke
