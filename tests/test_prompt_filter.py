"""`max_prompt_tokens` on a dataset: prompts over the budget (policy tokenizer,
BOS included, as the engines encode them) are dropped when read, counted in
the log, and announced by `plan`; with `long_prompts = truncate` they are
cut to the budget instead and their samples left out of the loss."""

from __future__ import annotations

import logging

import pytest
import torch

from rldsl.compiler.plan_view import render_plan
from rldsl.runtime.control.prompts import load_source, prompt_stream, train_prompt_count, truncated_prompt
from rldsl.runtime.protocols import (
    FIELD_LOSS_MASK,
    FIELD_RESPONSE_IDS,
    FIELD_RESPONSE_MASK,
    PROMPT_TRUNCATED,
    Prompt,
    mask_truncated_prompts,
    trained_tokens,
)
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


def with_truncation(tokens: int):
    return compiled(dataset=f'dataset prompts {{ source = "builtin:arith"  max_prompt_tokens = {tokens}  '
                            'long_prompts = truncate }')


def test_truncate_keeps_every_prompt_cut_to_the_budget_and_marked(caplog):
    everything = load_dataset("builtin:arith", "train", seed=0)
    long = [p for p in everything if len(p.text) + 1 > 6]
    pipe = with_truncation(6).plan.pipeline()
    with caplog.at_level(logging.WARNING, logger="rldsl.runtime.control.prompts"):
        kept = load_source(pipe, "builtin:arith", "train", 0)
    assert len(kept) == len(everything) and 0 < len(long) < len(everything)
    for original, prompt in zip(everything, kept):
        if len(original.text) + 1 <= 6:
            assert prompt == original
        else:  # the first 5 characters and the BOS: 6 tokens, the answer unchanged
            assert prompt.text == original.text[:5] and prompt.answer == original.answer
            assert prompt.meta[PROMPT_TRUNCATED] == len(original.text) + 1
    assert f"{len(long)} of {len(everything)} train prompts" in caplog.text and "truncated" in caplog.text
    assert train_prompt_count(pipe, 0) == len(everything)


def test_truncation_finds_the_longest_start_for_tokens_of_several_characters():
    words = lambda text: 1 + len(text.split())  # noqa: E731 -- a BOS and a token per word
    prompt = Prompt(3, "add seven and eleven then double it", "36")
    cut = truncated_prompt(prompt, words(prompt.text), 4, words)
    assert cut.text == "add seven and " and words(cut.text) == 4 and cut.meta == {PROMPT_TRUNCATED: 8}
    assert truncated_prompt(prompt, 8, 0, words) is None  # not even the BOS fits


def test_samples_of_truncated_prompts_leave_the_loss_and_keep_an_environments_mask():
    prompts = [Prompt(0, "1+1=", "2"), Prompt(1, "2+2=", "4", {PROMPT_TRUNCATED: 9}), Prompt(2, "3+3=", "6")]
    response_mask = torch.tensor([[1, 1, 0]] * 6)
    batch = {FIELD_RESPONSE_MASK: response_mask, FIELD_RESPONSE_IDS: response_mask * 7,
             FIELD_LOSS_MASK: torch.tensor([[1, 0, 0]] * 6)}
    assert mask_truncated_prompts(batch, prompts, samples_per_prompt=2) == 2
    assert batch[FIELD_LOSS_MASK].tolist() == [[1, 0, 0]] * 2 + [[0, 0, 0]] * 2 + [[1, 0, 0]] * 2
    del batch[FIELD_LOSS_MASK]
    mask_truncated_prompts(batch, prompts, samples_per_prompt=2)
    assert trained_tokens(batch).sum(dim=1).tolist() == [2, 2, 0, 0, 2, 2]
    whole = {FIELD_RESPONSE_MASK: response_mask}  # no prompt cut: the mask every batch carries trains all
    assert mask_truncated_prompts(whole, [prompts[0]] * 3, 2) == 0
    assert torch.equal(whole[FIELD_LOSS_MASK], response_mask)


def test_truncation_sends_a_loss_mask_to_the_trainer():
    def data_fields(result):
        return {f for e in result.plan.pipelines[0].edges if e.kind == "data" for f in e.fields}

    assert "loss_mask" in data_fields(with_truncation(6))
    assert "loss_mask" not in data_fields(with_budget(6))
    untruncated = compiled(dataset='dataset prompts { source = "builtin:arith"  long_prompts = truncate }')
    assert "loss_mask" not in data_fields(untruncated)  # no budget: nothing is cut


def test_plan_says_prompts_are_truncated_and_drop_stays_the_default():
    assert "those over 6 tokens are cut to 6 when the dataset is read" in render_plan(with_truncation(6))
    assert with_budget(6).plan.pipeline().datasets[0].options["long_prompts"] == "drop"
