"""The fence before the loss: a row whose behaviour logprobs were computed
with other weights than generated it is masked out and dropped as
`stale_logprobs`, never trained with a wrong importance ratio."""

from __future__ import annotations

import dataclasses

import pytest

import torch

from rldsl.runtime import protocols as p
from rldsl.runtime.dataplane.base import refuse_stale_logprobs
from rldsl.runtime.engines.sim import Latency
from rldsl.runtime.inprocess import SimConfig
from tests.test_controller import make_settings, run_controller


def test_rows_scored_with_other_weights_are_masked_out_and_named():
    fields = {p.FIELD_VERSION: torch.tensor([3, 3, 2]),
              p.version_field(p.FIELD_BEHAVIOUR_LOGPROBS): torch.tensor([3, 4, 2]),
              p.FIELD_RESPONSE_MASK: torch.ones(3, 4, dtype=torch.long)}
    assert refuse_stale_logprobs(fields) == [1]
    assert fields[p.FIELD_RESPONSE_MASK].sum(dim=1).tolist() == [4, 0, 4]


def test_behaviour_logprobs_that_came_with_the_sample_need_no_fence():
    fields = {p.FIELD_VERSION: torch.tensor([3]), p.FIELD_RESPONSE_MASK: torch.ones(1, 2)}
    assert refuse_stale_logprobs(fields) == []


def test_the_controller_drops_refused_rows_and_trains_the_rest():
    settings = make_settings(prompts_per_step=4, samples_per_prompt=2, steps=3, max_lag=1)
    config = SimConfig(generate=Latency.constant(0.001), microbatch=Latency.constant(0.001))

    def wrap(handles):
        async def train_microbatch(step, keys, replica):
            metrics = await handles.train_microbatch(step, keys, replica)
            return {**(metrics or {}), "refused_keys": [key for key in keys if key.endswith("/s1")]}

        return dataclasses.replace(handles, train_microbatch=train_microbatch)

    summary, _, _ = run_controller(settings, config, wrap=wrap)
    ledger = summary["ledger"]
    assert summary["steps"] == 3 and ledger["open"] == 0
    assert ledger["dropped"]["stale_logprobs"] == ledger["trained"] == 3 * 4


POLICY_LOGPROB = """
pipeline fenced
cluster { nodes = 1  gpus_per_node = 2 }
model policy { source = "builtin:tiny-lm" }
dataset prompts { source = "builtin:arith" }
stage generate rollout {
  model = policy  engine = sim(latency = 20ms)  gpus = 1  samples_per_prompt = 4  logprobs = false
}
stage reward score { fn = "rldsl.rewards:exact_match" }
stage logprob behaviour { model = policy  engine = sim(latency = 30ms)  colocate = actor }
stage train actor { model = policy  engine = sim(latency = 20ms)  gpus = 1  prompts_per_step = 4  micro_batch = 4 }
stage sync weights { from = actor  to = [rollout, behaviour] }
flow prompts -> rollout -> score -> behaviour -> actor
staleness { max_lag = 1 }
run { steps = 8  watchdog = 60s  eval_every = 0 }
"""


@pytest.mark.ray
def test_a_max_lag_1_run_with_a_policy_logprob_stage_drops_no_row_for_version_mismatch(tmp_path):
    from tests.runs import rldsl_here, run_text

    _, run_dir, summary = run_text(tmp_path, POLICY_LOGPROB, name="fenced.rlp")
    ledger = summary["ledger"]
    assert ledger["open"] == 0 and ledger["trained"] > 0
    assert set(ledger["dropped"]) <= {"run_finished"}  # 0 rows dropped for a version mismatch
    assert "stale_logprobs" not in ledger["dropped"]
    audit = rldsl_here("audit", str(run_dir))
    assert audit.returncode == 0, audit.stdout + audit.stderr  # every trained row's logprobs: the generating version
