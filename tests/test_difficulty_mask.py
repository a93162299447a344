"""Masking prompt groups out of the loss without replacing them
(`difficulty_mask`, ROLL's) and token-weighted whitening (`normalize =
batch_tokens`) in the controller, on sim engines in one process."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_controller import group_of, make_settings, prompt_stream, RecordingDataPlane  # noqa: E402
from test_training_keys import compiled  # noqa: E402

from rldsl.audit.replay import Replay  # noqa: E402
from rldsl.plan import ExecutionPlan  # noqa: E402
from rldsl.runtime.control.advantages import compute_advantages  # noqa: E402
from rldsl.runtime.control.controller import Controller  # noqa: E402
from rldsl.runtime.control.settings import settings_from_plan  # noqa: E402
from rldsl.runtime.inprocess import SimConfig, SimStages  # noqa: E402
from rldsl.runtime.protocols import FIELD_ADVANTAGE, FIELD_RESPONSE_MASK, FIELD_REWARD  # noqa: E402


def every_third_group_solved(inner):
    """Groups 0, 3, 6, ...: every sample right (mean 1, masked by [0.1, 0.95]); the others half right."""
    async def call(stage, keys):
        if group_of(keys[0]) % 3 == 0:
            return [1.0] * len(keys)
        return [float(i % 2) for i in range(len(keys))]
    return call


def run(settings, reward=every_third_group_solved):
    """Run to the end; (summary, step records, {group: (rewards, advantages, tokens)} of each trained group)."""
    dataplane = RecordingDataPlane()
    sim = SimStages(settings, dataplane, SimConfig())
    trained, records = {}, []

    async def microbatch(step, keys, replica):
        fields = dataplane.get(list(keys), "t", [FIELD_REWARD, FIELD_ADVANTAGE, FIELD_RESPONSE_MASK])
        trained[group_of(keys[0])] = (fields[FIELD_REWARD].tolist(), fields[FIELD_ADVANTAGE].tolist(),
                                      fields[FIELD_RESPONSE_MASK].sum(dim=1).tolist())
        return await sim.handles.train_microbatch(step, keys, replica)

    handles = dataclasses.replace(sim.handles, train_microbatch=microbatch, reward=reward(sim.handles.reward))
    controller = Controller(settings, handles, dataplane, prompt_stream(), on_step=records.append)
    summary = asyncio.run(controller.run())
    return summary, records, trained, controller


@pytest.mark.parametrize("normalize", ["group", "batch"])
def test_masked_groups_stay_in_their_step_with_no_loss_weight(normalize):
    settings = make_settings(prompts_per_step=3, samples_per_prompt=4, steps=3, max_lag=0,
                             difficulty_mask=(0.1, 0.95), normalize=normalize)
    summary, records, trained, controller = run(settings)
    assert summary["steps"] == 3
    # no replacement prompts: the three steps took exactly the first nine prompts, three each
    assert [r["groups"] for r in records] == [3, 3, 3]
    assert summary["ledger"]["generated"] == 9 * 4
    # the solved groups (0, 3, 6) never reached the trainer: no microbatch, so no token and no gradient
    assert sorted(trained) == [1, 2, 4, 5, 7, 8]
    assert summary["ledger"]["masked"] == 3 * 4 and summary["ledger"]["trained"] == 6 * 4
    assert summary["ledger"]["dropped"] == {}
    assert [r["masked"] for r in records] == [4, 4, 4] and [r["samples"] for r in records] == [8, 8, 8]
    # the masked groups are in no batch statistic: the trained groups' advantages are theirs alone
    for first in (1, 4, 7):
        pair = [trained[first][0], trained[first + 1][0]]
        expected = compute_advantages(pair, "grpo", normalize, settings.advantage_eps)
        assert [trained[first][1], trained[first + 1][1]] == [pytest.approx(a, abs=1e-5) for a in expected]
    # the journal says so too: masked, each once, in its step
    replay = Replay(max_lag=0).replay(controller.state.journal.drain())
    assert replay.totals()["masked"] == 12 and not replay.violations


def test_a_step_whose_groups_are_all_masked_trains_nothing_and_keeps_its_size():
    settings = make_settings(prompts_per_step=2, samples_per_prompt=2, steps=2, max_lag=0,
                             difficulty_mask=(0.1, 0.95))
    summary, records, trained, _ = run(settings, reward=lambda inner: _all_right)
    assert trained == {} and summary["steps"] == 2
    assert summary["ledger"]["masked"] == 2 * 2 * 2 and summary["ledger"]["trained"] == 0
    assert [r["groups"] for r in records] == [2, 2]


async def _all_right(stage, keys):
    return [1.0] * len(keys)


def test_without_a_mask_nothing_is_masked_and_the_records_are_as_before():
    summary, records, trained, _ = run(make_settings(prompts_per_step=3, samples_per_prompt=4, steps=2, max_lag=0))
    assert len(trained) == 6 and "masked" not in summary["ledger"] and "masked" not in records[0]


def test_batch_tokens_whitens_over_the_trained_tokens_of_the_step():
    settings = make_settings(prompts_per_step=3, samples_per_prompt=4, steps=2, max_lag=0,
                             advantage="reinforce_pp", normalize="batch_tokens")
    _, _, trained, _ = run(settings)
    for step_groups in ([0, 1, 2], [3, 4, 5]):
        rewards = [trained[g][0] for g in step_groups]
        tokens = [[int(n) for n in trained[g][2]] for g in step_groups]
        expected = compute_advantages(rewards, "reinforce_pp", "batch_tokens", settings.advantage_eps,
                                      tokens=tokens)
        assert expected != compute_advantages(rewards, "reinforce_pp", "batch", settings.advantage_eps)
        for group, advantages in zip(step_groups, expected):
            assert trained[group][1] == pytest.approx(advantages, abs=1e-5)


def test_reward_bias_and_scale_reach_the_advantages():
    settings = make_settings(prompts_per_step=3, samples_per_prompt=4, steps=1, max_lag=0, advantage="grpo",
                             normalize="none", reward_bias=-0.5, reward_scale=10.0, reward_clip=20.0)
    _, _, trained, _ = run(settings)
    assert trained[0][1] == [0.0] * 4  # all right: (1 - 0.5) x 10 = 5 each, the mean 5
    assert trained[1][1] == [-5.0, 5.0, -5.0, 5.0]  # rewards 0, 1, 0, 1: -5, 5, ... around a mean of 0
    assert trained[1][0] == [0.0, 1.0, 0.0, 1.0]  # the data plane keeps the rewards as scored


def test_the_settings_reach_the_controller_through_the_plan():
    plan = compiled("  advantage = reinforce_pp\n  normalize = batch_tokens\n  difficulty_mask = [0.1, 0.95]\n"
                    "  reward_bias = -0.5\n  reward_scale = 10\n  reward_clip = 20").plan
    settings = settings_from_plan(ExecutionPlan.from_json(plan.to_json()).pipeline())
    assert (settings.normalize, settings.difficulty_mask) == ("batch_tokens", (0.1, 0.95))
    assert (settings.reward_bias, settings.reward_scale, settings.reward_clip) == (-0.5, 10.0, 20.0)


def test_left_out_they_change_nothing():
    settings = settings_from_plan(compiled("").plan.pipeline())
    assert (settings.difficulty_mask, settings.reward_bias, settings.reward_scale) == (None, 0.0, 1.0)


def test_each_sample_weighs_the_tokens_its_loss_trains():
    import torch

    from rldsl.runtime.protocols import FIELD_LOSS_MASK, sample_token_counts

    batch = {FIELD_RESPONSE_MASK: torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])}
    assert sample_token_counts(batch) == (3, 4, 1)
    batch[FIELD_LOSS_MASK] = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])  # environment or truncated
    assert sample_token_counts(batch) == (2, 0, 1)
