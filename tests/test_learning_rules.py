"""Pipelines that cannot learn (RLP314) or cannot learn from every prompt (RLP315)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.tasks import ANSWER_CHARACTERS, load_dataset

BASE = (Path(__file__).parent / "golden" / "base.rlp").read_text()


def codes(text: str) -> list[str]:
    return sorted(d.code for d in compile_source(text, "p.rlp").diagnostics)


def test_the_builtin_answer_lengths_are_the_datas():
    for source, (shortest, longest) in ANSWER_CHARACTERS.items():
        lengths = {len(p.answer) for split in ("train", "eval") for p in load_dataset(source, split)}
        assert (min(lengths), max(lengths)) == (shortest, longest), source


def test_responses_shorter_than_every_answer_get_a_constant_reward():
    text = BASE.replace('"builtin:arith"', '"builtin:reverse"').replace(
        "  samples_per_prompt = 4\n", "  samples_per_prompt = 4\n  max_new_tokens = 2\n")
    assert codes(text) == ["RLP314"]


@pytest.mark.parametrize(("tokens", "expected"), [(2, ["RLP315"]), (3, []), (57, [])])  # 57: what the context holds
def test_responses_shorter_than_some_answers(tokens, expected):
    assert codes(BASE.replace("  samples_per_prompt = 4\n",
                              f"  samples_per_prompt = 4\n  max_new_tokens = {tokens}\n")) == expected


@pytest.mark.parametrize(("tokens", "expected"), [(1, ["RLP314"]), (3, ["RLP315"]), (4, [])])
def test_truncated_mask_needs_room_for_the_end_token_too(tokens, expected):
    """builtin:arith answers are 1 to 3 characters; a masked response trains only if it ended."""
    assert codes(BASE.replace("  samples_per_prompt = 4\n", f"  samples_per_prompt = 4\n  max_new_tokens = {tokens}\n"
                              "  truncated = mask\n")) == expected


def test_only_certain_cases_are_reported():
    short = BASE.replace("  samples_per_prompt = 4\n", "  samples_per_prompt = 4\n  max_new_tokens = 1\n")
    assert codes(short.replace('"rldsl.rewards:exact_match"', '"rldsl.rewards:char_match"')) == []  # partial credit
    assert codes(short.replace('"builtin:arith"', '"jsonl:data.jsonl"')) == []  # unknown answers


@pytest.mark.parametrize(("normalize", "expected"), [("group", ["RLP314"]), ("batch", []), ("none", [])])
def test_one_sample_per_prompt_normalised_by_its_group(normalize, expected):
    text = BASE.replace("  samples_per_prompt = 4\n", "  samples_per_prompt = 1\n").replace(
        "  prompts_per_step = 8\n", f"  prompts_per_step = 8\n  advantage = reinforce_pp\n  normalize = {normalize}\n")
    assert codes(text) == expected


def with_train(text: str, lines: str, samples: int = 4) -> str:
    return text.replace("  samples_per_prompt = 4\n", f"  samples_per_prompt = {samples}\n").replace(
        "  prompts_per_step = 8\n", f"  prompts_per_step = 8\n{lines}")


@pytest.mark.parametrize(("mask", "samples", "expected"), [
    ("[0.1, 0.95]", 4, []),  # 1/4, 2/4, 3/4 lie inside
    ("[0.9, 0.1]", 4, ["RLP314"]),  # an empty interval: every group masked, whatever the reward
    ("[0.5, 0.5]", 4, ["RLP314"]),
    ("[0.1, 0.95]", 1, ["RLP314"]),  # one 0/1 reward: a mean of 0 or 1, both outside
    ("[0.6, 0.7]", 2, ["RLP314"]),  # 0, 1/2, 1 (or 0 and 1 when a sample fails): none inside
    ("[0.6, 0.7]", 3, []),  # 2/3 lies inside
])
def test_a_difficulty_mask_that_masks_every_group(mask, samples, expected):
    estimator = "  advantage = reinforce_pp\n" if samples == 1 else ""  # a group baseline needs two (RLP303)
    assert codes(with_train(BASE, f"{estimator}  difficulty_mask = {mask}\n", samples)) == expected


def test_a_difficulty_mask_on_partial_credit_is_not_judged():
    text = with_train(BASE, "  advantage = reinforce_pp\n  difficulty_mask = [0.1, 0.95]\n", 1)
    assert codes(text.replace('"rldsl.rewards:exact_match"', '"rldsl.rewards:char_match"')) == []


def test_the_empty_interval_edit_swaps_the_bounds():
    (finding,) = compile_source(with_train(BASE, "  difficulty_mask = [0.9, 0.1]\n"), "p.rlp").diagnostics
    assert finding.edit[1] == "[0.1, 0.9]"
    assert codes(with_train(BASE, f"  difficulty_mask = {finding.edit[1]}\n")) == []


def test_a_difficulty_mask_takes_two_bounds():
    assert codes(with_train(BASE, "  difficulty_mask = [0.1, 0.5, 0.9]\n")) == ["RLP312"]


def test_a_zero_reward_scale_makes_every_reward_zero():
    assert codes(with_train(BASE, "  reward_scale = 0\n")) == ["RLP314"]
    assert codes(with_train(BASE, "  reward_scale = 10  reward_bias = -0.5\n")) == []
