"""Token-budget forwards: the chunking by hand, packed forwards (every row's
real tokens in one sequence, for the builtin model and a Hugging Face one)
give the padded forward's logprobs, and split steps with a budget still
equal the full-batch gradient."""

import random

import pytest
import torch

from rldsl.models import load_model
from rldsl.runtime.engines.torch import TorchLogprob
from rldsl.runtime.engines.torch.common import packed_response_logprobs, response_logprobs
from rldsl.runtime.engines.torch.packing import forward_rows, real_lengths, token_budget_chunks, trim_padding
from tests.test_split_step_gradient import (
    LOSS_CONFIGS,
    full_batch_gradients,
    make_batch,
    make_model,
    max_relative_error,
    split_step_gradients,
)


def test_chunks_by_hand():
    # First-fit decreasing needs 3 groups; longest first, each row to the least loaded group it fits:
    # 8 -> A, 7 -> B, 5 -> C, 3 -> C (8), 2 -> B (9)  => rows {2}, {3, 4}, {0, 1}.
    assert token_budget_chunks([5, 3, 8, 2, 7], 10) == [[0, 1], [2], [3, 4]]
    # A row longer than the budget goes alone; the others still share.
    assert token_budget_chunks([12, 3, 4], 10) == [[0], [1, 2]]
    assert token_budget_chunks([], 10) == []
    with pytest.raises(ValueError, match="positive"):
        token_budget_chunks([1], 0)


def test_chunks_cover_every_row_once_within_the_budget():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(1, 80)
        chunks = token_budget_chunks(lengths, budget)
        assert sorted(row for chunk in chunks for row in chunk) == list(range(len(lengths)))
        for chunk in chunks:
            assert len(chunk) == 1 or sum(lengths[row] for row in chunk) <= budget


def test_forward_rows_by_rows_or_by_budget():
    batch = make_batch(make_model())
    assert forward_rows(batch, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert forward_rows(batch, None) == [list(range(10))]
    lengths = real_lengths(batch)
    for chunk in forward_rows(batch, 4, tokens_per_forward=20):  # the budget wins over the row count
        assert len(chunk) == 1 or sum(lengths[row] for row in chunk) <= 20


def test_trimming_drops_only_padding():
    model = make_model()
    batch = make_batch(model)
    rows = {name: value[[2, 5]] for name, value in batch.items()}  # prompts 4 and 5 of 6, responses 2 and 1 of 5
    trimmed = trim_padding(rows)
    assert trimmed["prompt_ids"].shape == trimmed["prompt_mask"].shape == (2, 5)
    response_width = 2
    for name in ("response_ids", "response_mask", "behaviour_logprobs", "ref_logprobs"):
        assert trimmed[name].shape == (2, response_width), name
    with torch.no_grad():
        full = response_logprobs(model, rows)
        short = response_logprobs(model, trimmed)
    assert torch.allclose(full[:, :response_width], short, atol=1e-5)
    assert not full[:, response_width:].any()


@pytest.mark.parametrize("budget", [0, 12, 40])
def test_logprob_engine_with_a_budget_gives_the_same_logprobs(budget):
    model = make_model()
    batch = make_batch(model)
    expected = TorchLogprob(make_model(), rows_per_forward=3).logprobs(batch)
    actual = TorchLogprob(make_model(), tokens_per_forward=budget).logprobs(batch)
    assert actual.shape == expected.shape and torch.allclose(actual, expected, atol=1e-5)


def test_the_builtin_model_packs_rows_into_one_sequence():
    model = make_model()
    batch = make_batch(model)
    with torch.no_grad():
        padded = response_logprobs(model, batch)
        packed = packed_response_logprobs(model, batch)
    assert (packed - padded).abs().max() < 1e-5
    budgeted = TorchLogprob(make_model(), tokens_per_forward=25).logprobs(batch)
    assert (budgeted - padded).abs().max() < 1e-5


# -- Hugging Face: real packing ------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model_path(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf_tiny import save_char_llama

    return save_char_llama(tmp_path_factory.mktemp("llama"))


def test_packed_rows_give_the_unpacked_logprobs(hf_model_path):
    model = load_model(f"hf:{hf_model_path}")
    batch = make_batch(model)
    with torch.no_grad():
        padded = response_logprobs(model, batch)
        packed = packed_response_logprobs(model, batch)
    assert (packed - padded).abs().max() < 1e-5
    budgeted = TorchLogprob(load_model(f"hf:{hf_model_path}"), tokens_per_forward=25).logprobs(batch)
    assert (budgeted - padded).abs().max() < 1e-5


@pytest.mark.parametrize("config", LOSS_CONFIGS, ids=lambda c: c.agg)
def test_packed_split_step_equals_full_batch(hf_model_path, config):
    model = load_model(f"hf:{hf_model_path}")
    batch = make_batch(model)
    expected = full_batch_gradients(model, batch, config)
    actual = split_step_gradients(model, batch, config, [(0, 7), (7, 10)], tokens_per_forward=30)
    assert max_relative_error(actual, expected) < 1e-5
