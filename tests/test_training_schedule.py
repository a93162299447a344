"""The train pump's schedule of one rollout batch: mini-batches and their
optimizer steps, ppo_epochs replays, batch-normalised advantages, and
dynamic sampling, on sim engines in one process."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_controller import group_of, make_settings, prompt_stream, RecordingDataPlane  # noqa: E402

from rldsl.runtime.control.advantages import compute_advantages  # noqa: E402
from rldsl.runtime.control.controller import Controller  # noqa: E402
from rldsl.runtime.inprocess import SimConfig, SimStages  # noqa: E402
from rldsl.runtime.protocols import FIELD_ADVANTAGE  # noqa: E402


def run_logged(settings, *, reward=None):
    """Run to the end, logging every trainer call in order: ("mb", step, group), ("opt", step), ("finish", step)."""
    dataplane = RecordingDataPlane()
    sim = SimStages(settings, dataplane, SimConfig())
    log: list[tuple] = []
    handles = sim.handles

    async def microbatch(step, keys, replica):
        log.append(("mb", step, group_of(keys[0])))
        return await handles.train_microbatch(step, keys, replica)

    async def optimizer_step(step):
        log.append(("opt", step))
        return await handles.optimizer_step(step)

    async def finish(step):
        log.append(("finish", step))
        return await handles.finish_train_step(step)

    wrapped = dataclasses.replace(handles, train_microbatch=microbatch, optimizer_step=optimizer_step,
                                  finish_train_step=finish)
    if reward is not None:
        wrapped = dataclasses.replace(wrapped, reward=reward(handles.reward))
    summary = asyncio.run(Controller(settings, wrapped, dataplane, prompt_stream()).run())
    return summary, log, dataplane


def kinds(log, step):
    return [entry[0] for entry in log if entry[1] == step]


def test_mini_batches_and_epochs_take_an_optimizer_step_after_each_mini_batch():
    settings = make_settings(prompts_per_step=4, minibatch_groups=2, ppo_epochs=2, steps=2, max_lag=0)
    summary, log, _ = run_logged(settings)
    assert summary["steps"] == 2
    for step in range(2):
        assert kinds(log, step) == ["mb", "mb", "opt", "mb", "mb", "opt", "mb", "mb", "opt", "mb", "mb", "finish"]
        groups = [entry[2] for entry in log if entry[0] == "mb" and entry[1] == step]
        assert sorted(groups[:4]) == sorted(groups[4:]) and len(set(groups)) == 4  # each group once per epoch
    assert summary["ledger"]["trained"] == 2 * 4 * settings.samples_per_prompt  # a replay trains nothing twice


def test_one_mini_batch_keeps_one_optimizer_step_per_rollout_batch():
    summary, log, _ = run_logged(make_settings(prompts_per_step=3, steps=2))
    assert [entry[0] for entry in log].count("opt") == 0
    assert kinds(log, 0) == ["mb", "mb", "mb", "finish"]


def test_batch_normalisation_waits_for_the_rollout_batch_and_whitens_over_it():
    settings = make_settings(prompts_per_step=3, samples_per_prompt=4, steps=2, advantage="reinforce_pp",
                             normalize="batch", max_lag=0)
    dataplane = RecordingDataPlane()
    sim = SimStages(settings, dataplane, SimConfig())
    consumed_at_first_microbatch, written = [], {}

    async def microbatch(step, keys, replica):
        if len(written) % 3 == 0:
            consumed_at_first_microbatch.append(controller.state.consumed_in_step)
        fields = dataplane.get(list(keys), "t", [FIELD_ADVANTAGE, "reward"])
        written[group_of(keys[0])] = (fields["reward"].tolist(), fields[FIELD_ADVANTAGE].tolist())
        return await sim.handles.train_microbatch(step, keys, replica)

    handles = dataclasses.replace(sim.handles, train_microbatch=microbatch)
    controller = Controller(settings, handles, dataplane, prompt_stream())
    asyncio.run(controller.run())
    assert consumed_at_first_microbatch == [3, 3]  # every group of the step was in before the first microbatch
    groups = sorted(written)
    for step_groups in (groups[:3], groups[3:]):
        rewards = [written[g][0] for g in step_groups]
        expected = compute_advantages(rewards, "reinforce_pp", "batch", settings.advantage_eps)
        for group, advantages in zip(step_groups, expected):
            assert written[group][1] == pytest.approx(advantages, abs=1e-5)


def test_dynamic_sampling_drops_equal_reward_groups_and_keeps_steps_full():
    settings = make_settings(prompts_per_step=3, samples_per_prompt=2, steps=3, dynamic_sampling=True)

    def reward(inner):
        async def call(stage, keys):
            if group_of(keys[0]) % 2 == 0:  # even groups: both samples equally right
                return [1.0] * len(keys)
            return [float(i % 2) for i in range(len(keys))]
        return call

    summary, log, _ = run_logged(settings, reward=reward)
    assert summary["steps"] == 3
    assert summary["ledger"]["dropped"].get("zero_variance", 0) >= 3 * settings.samples_per_prompt
    for step in range(3):
        groups = [entry[2] for entry in log if entry[0] == "mb" and entry[1] == step]
        assert len(groups) == 3 and all(g % 2 == 1 for g in groups)
    assert summary["ledger"]["trained"] == 3 * 3 * 2
