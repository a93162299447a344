"""A policy logprob stage scores every row with the weights that generated
it, so the trainer's fence drops no row for a version mismatch."""

from __future__ import annotations

import pytest
import torch

from rldsl.runtime import protocols as p
from rldsl.runtime.dataplane.base import refuse_stale_logprobs
from rldsl.runtime.engines.torch import TorchLogprob
from rldsl.runtime.engines.torch.common import state_buckets
from rldsl.runtime.ray_lowering.logprob_versions import VersionedScorer
from tests.test_batching import small_model


class OffsetEngine:
    """Log-probabilities that say which weights computed them: the version, on every response token."""

    def __init__(self):
        self.version = 0
        self.updates = 0

    def logprobs(self, batch):
        return batch[p.FIELD_RESPONSE_MASK].float() * -(self.version + 1)

    def update_weights(self, bucket, version, last):
        self.updates += 1
        if last:
            self.version = version

    def weight_snapshot(self):
        return [{}]


def batch(rows: int, width: int = 3) -> dict:
    return {p.FIELD_RESPONSE_IDS: torch.ones(rows, width, dtype=torch.long),
            p.FIELD_RESPONSE_MASK: torch.ones(rows, width, dtype=torch.long)}


def fetched(refs):
    return [{"ref": ref} for ref in refs]


def test_each_row_is_scored_with_the_version_that_generated_it():
    scorer = VersionedScorer(OffsetEngine(), window=1, fetch=fetched)
    scorer.receive(["b1"], 1)  # pushed, not applied: rows of version 0 are still arriving
    values, used = scorer.score(batch(4), [0, 1, 0, 1])
    assert used == [0, 1, 0, 1]
    assert values[:, 0].tolist() == [-1.0, -2.0, -1.0, -2.0]
    values, used = scorer.score(batch(1), [0])  # a late row of the first version: its weights were kept
    assert used == [0] and values[0, 0].item() == -1.0


def test_versions_older_than_the_staleness_window_are_let_go():
    scorer = VersionedScorer(OffsetEngine(), window=1, fetch=fetched)
    for version in (1, 2, 3):
        scorer.receive([f"b{version}"], version)
    assert sorted(scorer.kept) == [2, 3]
    _, used = scorer.score(batch(2), [1, 3])  # version 1 is gone: the newest, and the fence drops the row
    assert used == [3, 3]


def test_rows_of_the_loaded_version_cost_no_load():
    engine = OffsetEngine()
    scorer = VersionedScorer(engine, window=2, fetch=fetched)
    scorer.receive(["b1"], 1)
    scorer.score(batch(2), [1, 1])
    scorer.score(batch(3), [1, 1, 1])
    assert scorer.loads == 1 and engine.updates == 1


def test_a_torch_logprob_stage_scores_old_rows_with_the_old_weights_and_the_fence_passes_them():
    old_model, new_model = small_model(0), small_model(7)
    engine = TorchLogprob(small_model(0))
    rows = {p.FIELD_PROMPT_IDS: torch.tensor([[3, 4], [5, 6]]), p.FIELD_PROMPT_MASK: torch.ones(2, 2, dtype=torch.long),
            p.FIELD_RESPONSE_IDS: torch.tensor([[7, 8], [9, 10]]),
            p.FIELD_RESPONSE_MASK: torch.ones(2, 2, dtype=torch.long)}
    scorer = VersionedScorer(engine, window=1, fetch=lambda refs: refs)
    scorer.receive(list(state_buckets(new_model.module, 1 << 20)), 1)
    values, used = scorer.score(rows, [1, 0])
    expected_new = TorchLogprob(new_model).logprobs(rows)
    expected_old = TorchLogprob(old_model).logprobs(rows)
    assert torch.allclose(values[0], expected_new[0]) and torch.allclose(values[1], expected_old[1])
    assert not torch.allclose(expected_new[1], expected_old[1])  # the versions do differ
    fields = {**rows, p.FIELD_VERSION: torch.tensor([1, 0]),
              p.version_field(p.FIELD_BEHAVIOUR_LOGPROBS): torch.tensor(used)}
    assert refuse_stale_logprobs(fields) == []


@pytest.mark.parametrize("late", [0, 1])
def test_the_scored_tensor_keeps_the_batch_width(late):
    scorer = VersionedScorer(OffsetEngine(), window=1, fetch=fetched)
    scorer.receive(["b1"], 1)
    values, _ = scorer.score(batch(3, width=5), [late, 1, 0])
    assert values.shape == (3, 5)
