"""`stage logprob { recompute = batch_start }`: a policy logprob stage scores
each row with the trainer's weights at the start of the step that trains it
(verl's and ROLL's old-log-prob recompute); the fence compares with the
trainer's version, so no row is dropped for a version mismatch."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from rldsl.runtime import protocols as p
from rldsl.runtime.dataplane.base import refuse_stale_logprobs
from rldsl.runtime.engines.torch import TorchGenerator, TorchLogprob, TorchTrainer
from rldsl.runtime.engines.torch.common import state_buckets
from rldsl.runtime.ray_lowering.logprob_versions import VersionedScorer

from tests.runs import rldsl_here, run_text
from tests.test_controller import make_settings, run_controller
from tests.test_fence import POLICY_LOGPROB
from tests.test_torch_engines import small_model, trained_batch


def test_the_fence_compares_with_the_trainers_version_when_asked():
    fields = {p.FIELD_VERSION: torch.tensor([2, 3, 3]),
              p.version_field(p.FIELD_BEHAVIOUR_LOGPROBS): torch.tensor([3, 3, 2]),
              p.FIELD_RESPONSE_MASK: torch.ones(3, 4, dtype=torch.long)}
    assert refuse_stale_logprobs(dict(fields), expected=3) == [2]  # row 0, generated at 2, scored at 3: fine
    assert refuse_stale_logprobs(dict(fields)) == [0, 2]  # against the generating versions


def test_rows_are_scored_with_the_trainers_batch_start_weights():
    trainer = TorchTrainer(small_model(seed=1), lr=1e-2)
    batch = trained_batch(TorchGenerator(small_model(seed=1)))
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, batch)
    assert trainer.finish_train_step(0).version == 1
    scorer = VersionedScorer(TorchLogprob(small_model(seed=1)), window=0, fetch=lambda refs: refs)
    scorer.receive(list(state_buckets(trainer.model.module, 1 << 20)), 1)  # the push of version 1
    batch_start = TorchLogprob(copy.deepcopy(trainer.model)).logprobs(batch)
    initial = TorchLogprob(small_model(seed=1)).logprobs(batch)

    trainer.begin_train_step(1)  # mini-batch optimizer steps move the weights inside the step, not the version
    trainer.train_microbatch(1, batch)
    trainer.optimizer_step(1)
    generated_at = [0] * len(batch[p.FIELD_VERSION])  # every row came from the initial weights
    values, used = scorer.score_at(batch, generated_at, version=trainer.version)
    assert used == [1] * len(generated_at)
    assert torch.allclose(values, batch_start, atol=1e-6)
    assert not torch.allclose(values, initial, atol=1e-4)  # the versions do differ
    fenced = {**batch, p.FIELD_VERSION: torch.tensor(generated_at), p.version_field(p.FIELD_BEHAVIOUR_LOGPROBS):
              torch.tensor(used)}
    assert refuse_stale_logprobs(fenced, expected=trainer.version) == []


def test_the_train_pump_scores_each_group_at_the_trainers_version_before_its_microbatch():
    settings = make_settings(prompts_per_step=2, samples_per_prompt=2, steps=4, max_lag=1,
                             logprob_stages=("behaviour",), policy_logprob_stages=("behaviour",),
                             batch_start_logprob_stages=("behaviour",))
    calls: list[tuple] = []  # ("logprob", keys, version) and ("train", keys, step)

    def wrap(handles):
        import dataclasses

        async def logprob(stage, keys, version=None):
            calls.append(("logprob", tuple(keys), version))
            return await handles.logprob(stage, keys, version)

        async def train_microbatch(step, keys, replica):
            calls.append(("train", tuple(keys), step))
            return await handles.train_microbatch(step, keys, replica)

        return dataclasses.replace(handles, logprob=logprob, train_microbatch=train_microbatch)

    records: list[dict] = []
    summary, _, _ = run_controller(settings, wrap=wrap, on_step=records.append)
    assert summary["steps"] == 4 and summary["ledger"]["open"] == 0
    assert "stale_logprobs" not in summary["ledger"]["dropped"]
    scored = [c for c in calls if c[0] == "logprob"]
    assert scored and all(version is not None for _, _, version in scored)  # never the rollout pump's call
    trained = [c for c in calls if c[0] == "train"]
    assert [keys for _, keys, _ in scored] == [keys for _, keys, _ in trained]  # each group, right before
    versions_by_step = {record["batch"]: record["version"] - 1 for record in records}
    for (_, keys, version), (_, _, step) in zip(scored, trained):
        assert version == versions_by_step[step]  # the version the step trained at


@pytest.mark.ray
def test_a_max_lag_1_run_that_recomputes_at_batch_start_drops_no_row(tmp_path):
    text = POLICY_LOGPROB.replace("engine = sim(latency = 30ms)  colocate = actor",
                                  "engine = sim(latency = 30ms)  colocate = actor  recompute = batch_start")
    assert text != POLICY_LOGPROB
    _, run_dir, summary = run_text(tmp_path, text, name="batch_start.rlp")
    ledger = summary["ledger"]
    assert ledger["open"] == 0 and ledger["trained"] > 0
    assert set(ledger["dropped"]) <= {"run_finished"}  # 0 rows dropped for a version mismatch
    events = [json.loads(line) for line in (run_dir / "journal.jsonl").read_text().splitlines()]
    assert any(e.get("batch_start") for e in events)
    audit = rldsl_here("audit", str(run_dir))
    assert audit.returncode == 0, audit.stdout + audit.stderr  # behaviour logprobs: the trained version
