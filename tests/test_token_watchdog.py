"""The watchdog measures progress in decoded tokens as well as finished
work: a generator that decodes slowly but steadily for longer than the
watchdog's timeout is not called stalled, one that decodes nothing is."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from rldsl.runtime.control.controller import PipelineStalled
from rldsl.runtime.engines.torch import TorchGenerator
from rldsl.runtime.protocols import Prompt
from tests.test_batching import small_model
from tests.test_controller import make_settings, run_controller

WATCHDOG_S = 0.4
GROUP_S = 1.2  # one group takes three watchdog timeouts


def slow_generation(tokens: list[int], tokens_per_tick: int):
    """Handles whose generate takes ``GROUP_S`` per group, adding
    ``tokens_per_tick`` to ``tokens`` every 50 ms while it decodes."""
    def wrap(handles):
        async def generate(replica, prompts, keys, samples_per_prompt, seed):
            ends = time.monotonic() + GROUP_S
            while time.monotonic() < ends:
                await asyncio.sleep(0.05)
                tokens[replica] += tokens_per_tick
            return await handles.generate(replica, prompts, keys, samples_per_prompt, seed)

        async def decoded_tokens():
            return list(tokens)

        return dataclasses.replace(handles, generate=generate, decoded_tokens=decoded_tokens)

    return wrap


def settings():
    return make_settings(prompts_per_step=1, samples_per_prompt=2, steps=2, max_lag=0, watchdog_timeout_s=WATCHDOG_S)


def test_a_generator_decoding_slowly_but_steadily_is_not_stalled():
    summary, _, _ = run_controller(settings(), wrap=slow_generation([0], tokens_per_tick=3))
    assert summary["steps"] == 2 and summary["exit"] == "finished"
    assert summary["elapsed_s"] > 2 * WATCHDOG_S  # the watchdog's timeout passed without finished work


def test_a_generator_that_decodes_no_token_is_stalled():
    with pytest.raises(PipelineStalled, match=r"the generators decoded no token either \(0 decoded in all\)"):
        run_controller(settings(), wrap=slow_generation([0], tokens_per_tick=0))


def test_token_progress_that_stops_is_stalled_after_the_timeout():
    tokens = [0]

    def wrap(handles):
        wrapped = slow_generation(tokens, tokens_per_tick=1)(handles)

        async def generate(replica, prompts, keys, samples_per_prompt, seed):
            if tokens[0] >= 5:  # decodes a few tokens, then hangs without any
                await asyncio.sleep(3600)
            return await wrapped.generate(replica, prompts, keys, samples_per_prompt, seed)

        return dataclasses.replace(wrapped, generate=generate)

    with pytest.raises(PipelineStalled, match=r"decoded no token for \d+\.\ds"):
        run_controller(settings(), wrap=wrap)


def test_the_torch_generator_counts_tokens_at_every_decode_step():
    generator = TorchGenerator(small_model(), max_new_tokens=6, temperature=0.0)
    generator.admit([([Prompt(0, "1+1=", "2")], 3, 0)])
    counts = []
    while generator.rows_in_flight:
        generator.decode_step()
        counts.append(generator.tokens_decoded)
    assert counts[:3] == [3, 6, 9]  # three rows, one token each per step, before any group ends
