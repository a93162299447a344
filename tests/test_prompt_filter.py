"""`max_prompt_tokens` on a dataset: prompts over the budget (policy tokenizer,
BOS included, as the engines encode them) are dropped when read, counted in
the log, and announced by `plan`."""

from __future__ import annotations

import logging

import pytest

from rldsl.compiler.plan_view import render_plan
from rldsl.runtime.control.prompts import load_source, prompt_stream, train_prompt_count
from rldsl.tasks import DatasetError, load_dataset
from tests.test_training_keys import compiled

ARITH = 'dataset prompts { source = "builtin:arith" }'


def with_budget(tokens: int):
    return compiled(dataset=f'dataset prompts {{ source = "builtin:arith"  max_prompt_tokens = {tokens} }}')


def test_prompts_over_the_budget_are_dropped_and_counted(caplog):
    everything = load_dataset("builtin:arith", "train", seed=0)
    short = [p for p in everything if len(p.text) + 1 <= 6]  # the builtin tokenizer: a token per character + BOS
    assert 0 < len(short) < len(everything)
    pipe = with_budget(6).plan.pipeline()
    with caplog.at_level(logging.WARNING, logger="rldsl.runtime.control.prompts"):
        kept = load_source(pipe, "builtin:arith", "train", 0)
    assert [p.text for p in kept] == [p.text for p in short]
    assert f"{len(everything) - len(short)} of {len(everything)} train prompts" in caplog.text
    assert train_prompt_count(pipe, 0) == len(short)
    stream = prompt_stream(pipe, 0)
    assert all(len(next(stream).text) <= 5 for _ in range(50))


def test_without_a_budget_every_prompt_is_kept():
    pipe = compiled(dataset=ARITH).plan.pipeline()
    assert len(load_source(pipe, "builtin:arith", "train", 0)) == len(load_dataset("builtin:arith", "train", seed=0))
    assert "prompts: those over" not in render_plan(compiled(dataset=ARITH))


def test_plan_says_the_filter_and_a_budget_nothing_fits_is_a_clear_error():
    assert "prompts: those over 6 tokens are dropped when the dataset is read" in render_plan(with_budget(6))
    with pytest.raises(DatasetError, match="every train prompt of builtin:arith is longer than max_prompt_tokens = 2"):
        load_source(with_budget(2).plan.pipeline(), "builtin:arith", "train", 0)
