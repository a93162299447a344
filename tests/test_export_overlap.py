"""An export that may run beside the trainer's step (a rank-to-rank push
from a torch, megatron or fsdp trainer) runs while the next step fills and trains; whatever changes the
weights (an optimizer step, the step's finish) waits until it ends."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from rldsl.runtime.engines.sim import Latency
from rldsl.runtime.inprocess import SimConfig
from tests.test_controller import make_settings, run_controller

EXPORT_S = 0.15


def _timeline(overlaps: bool):
    """A run whose every export takes EXPORT_S: (summary, exports, microbatches,
    weight changes made while an export ran), intervals as (start, end)."""
    settings = make_settings(prompts_per_step=4, samples_per_prompt=2, steps=4, max_lag=1, minibatch_groups=2)
    config = SimConfig(generate=Latency.constant(0.001), microbatch=Latency.constant(0.005))
    exports, microbatches, violations = [], [], []
    exporting: set[int] = set()

    def wrap(handles):
        async def export_weights(version):
            exporting.add(version)
            start = time.monotonic()
            await asyncio.sleep(EXPORT_S)
            await handles.export_weights(version)
            exporting.discard(version)
            exports.append((start, time.monotonic()))

        async def train_microbatch(*args):
            start = time.monotonic()
            result = await handles.train_microbatch(*args)
            microbatches.append((start, time.monotonic()))
            return result

        def changes_weights(name, call):
            async def guarded(step):
                if exporting:
                    violations.append((name, step, sorted(exporting)))
                return await call(step)
            return guarded

        return dataclasses.replace(handles, export_weights=export_weights, train_microbatch=train_microbatch,
                                   finish_train_step=changes_weights("finish", handles.finish_train_step),
                                   optimizer_step=changes_weights("optimizer step", handles.optimizer_step),
                                   export_overlaps=overlaps)

    summary, _, _ = run_controller(settings, config, wrap=wrap)
    return summary, exports, microbatches, violations


def _during(intervals, spans) -> int:
    """How many ``intervals`` start inside one of ``spans``."""
    return sum(any(s < start < e for s, e in spans) for start, _ in intervals)


@pytest.mark.parametrize("overlaps", [True, False])
def test_the_next_step_trains_while_an_export_that_reads_alone_runs(overlaps):
    summary, exports, microbatches, violations = _timeline(overlaps)
    ledger = summary["ledger"]
    assert summary["steps"] == 4 and ledger["open"] == 0 and ledger["trained"] == 4 * 4 * 2
    assert len(exports) == 4
    assert violations == []  # no optimizer step or finish while the weights were being read
    overlapped = _during(microbatches, exports)
    if overlaps:
        assert overlapped >= 3, (exports, microbatches)  # each step after an export began during it
    else:
        assert overlapped == 0  # the export held the trainer, as before
