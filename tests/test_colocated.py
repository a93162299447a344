"""Colocated generators and trainer take turns: no generate call overlaps
a training call, and the generators sleep for every step and wake after it."""

from __future__ import annotations

import dataclasses
import time

import pytest

from rldsl.runtime.engines.sim import Latency
from rldsl.runtime.inprocess import SimConfig
from tests.test_controller import make_settings, run_controller, timed


def recording(intervals: list, events: list):
    def wrap(handles):
        async def sleep(replicas):
            events.append(("sleep", time.monotonic()))
            await handles.sleep_generators(replicas)

        async def wake(replicas, version):
            events.append(("wake", time.monotonic()))
            await handles.wake_generators(replicas, version)

        return dataclasses.replace(
            handles,
            generate=timed(intervals, "generate", handles.generate),
            train_microbatch=timed(intervals, "train", handles.train_microbatch),
            finish_train_step=timed(intervals, "train", handles.finish_train_step),
            sleep_generators=sleep, wake_generators=wake)
    return wrap


@pytest.mark.parametrize("max_lag", [0, 1])
def test_generation_and_training_never_overlap_when_colocated(max_lag):
    settings = make_settings(prompts_per_step=3, samples_per_prompt=2, steps=4, max_lag=max_lag,
                             sleeping_replicas=(0, 1))
    config = SimConfig(generate=Latency.constant(0.01), microbatch=Latency.constant(0.01),
                       finish=Latency.constant(0.01), generators=2)
    intervals, events = [], []
    summary, _, _ = run_controller(settings, config, wrap=recording(intervals, events))
    assert summary["steps"] == 4
    ledger = summary["ledger"]
    assert ledger["generated"] == ledger["trained"] + sum(ledger["dropped"].values())
    generate = [(s, e) for name, _, s, e in intervals if name == "generate"]
    train = [(s, e) for name, _, s, e in intervals if name == "train"]
    assert generate and train
    for gs, ge in generate:
        for ts, te in train:
            assert ge <= ts or te <= gs, "a generate call overlapped a training call"
    kinds = [kind for kind, _ in events]
    assert kinds == ["sleep", "wake"] * 4  # once per step, in turn


def test_streaming_overlaps_when_not_colocated():
    settings = make_settings(prompts_per_step=3, samples_per_prompt=2, steps=4, max_lag=1)
    config = SimConfig(generate=Latency.constant(0.02), microbatch=Latency.constant(0.02), generators=2)
    intervals, events = [], []
    run_controller(settings, config, wrap=recording(intervals, events))
    generate = [(s, e) for name, _, s, e in intervals if name == "generate"]
    train = [(s, e) for name, _, s, e in intervals if name == "train"]
    overlapped = any(not (ge <= ts or te <= gs) for gs, ge in generate for ts, te in train)
    assert overlapped and not events  # the same recorder sees overlap without colocation


