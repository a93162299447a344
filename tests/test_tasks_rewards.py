"""Builtin tasks, jsonl datasets, rewards, the reward guard and the tokenizer."""

import json
import math
import time

import pytest

from rldsl.models.tokenizer import CharTokenizer
from rldsl.rewards import RewardLoadError, char_match, exact_match, load_reward, safe_reward
from rldsl.tasks import DatasetError, load_dataset

# -- builtin tasks -----------------------------------------------------------------


@pytest.mark.parametrize("source", ["builtin:arith", "builtin:reverse"])
def test_builtin_splits_are_disjoint_and_deterministic(source):
    train = load_dataset(source, "train", seed=0)
    held_out = load_dataset(source, "eval", seed=0)
    assert len(train) > 1000 and len(held_out) >= 400
    assert not {p.text for p in train} & {p.text for p in held_out}
    assert load_dataset(source, "train", seed=0) == train
    other_seed = load_dataset(source, "eval", seed=1)
    assert not {p.text for p in other_seed} & {p.text for p in train}  # disjoint for every seed
    assert [p.index for p in train[:5]] == [0, 1, 2, 3, 4]


def test_builtin_answers_are_right():
    for prompt in load_dataset("builtin:arith", "eval")[:50]:
        left, right = prompt.text.rstrip("=").split("+")
        assert prompt.answer == str(int(left) + int(right))
    for prompt in load_dataset("builtin:reverse", "eval", size=50):
        word = prompt.text.removeprefix("reverse ").removesuffix(":")
        assert prompt.answer == word[::-1]


def test_seed_reorders_but_keeps_the_split():
    a = load_dataset("builtin:arith", "train", seed=0)
    b = load_dataset("builtin:arith", "train", seed=1)
    assert a != b and sorted(p.text for p in a) == sorted(p.text for p in b)


def test_unknown_source_and_split():
    with pytest.raises(DatasetError, match="unknown dataset source 'builtin:chess'"):
        load_dataset("builtin:chess", "train")
    with pytest.raises(DatasetError, match="unknown split 'test'"):
        load_dataset("builtin:arith", "test")


# -- jsonl -------------------------------------------------------------------------


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_rows_fields_and_split_placeholder(tmp_path):
    write_lines(tmp_path / "train.jsonl", [json.dumps({"q": "1+1=", "a": 2}), "", json.dumps({"q": "2+2=", "a": "4"})])
    prompts = load_dataset(f"jsonl:{tmp_path}/{{split}}.jsonl", "train", prompt_field="q", answer_field="a")
    assert [(p.index, p.text, p.answer) for p in prompts] == [(0, "1+1=", "2"), (1, "2+2=", "4")]
    assert prompts[1].meta["line"] == 3


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "x", "answer": ', r"bad\.jsonl:2: invalid JSON"),
        ('{"prompt": "x"}', r"bad\.jsonl:2: missing field 'answer' \(fields present: prompt\)"),
        ('["prompt", "answer"]', r"bad\.jsonl:2: expected a JSON object, got list"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "ok", "answer": "1"}', line])
    with pytest.raises(DatasetError, match=message):
        load_dataset(f"jsonl:{path}", "train")


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(DatasetError, match="cannot read the file"):
        load_dataset(f"jsonl:{tmp_path}/absent.jsonl", "train")
    empty = write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DatasetError, match="no rows"):
        load_dataset(f"jsonl:{empty}", "train")


# -- rewards -----------------------------------------------------------------------


def test_exact_and_partial_rewards():
    assert exact_match(" 19 ", "19", "12+7=") == 1.0
    assert exact_match("18", "19", "12+7=") == 0.0
    assert char_match("18", "19") == 0.5
    assert char_match("19", "19") == 1.0
    assert char_match("1", "19") == 0.5  # missing characters cost
    assert char_match("190", "19") == pytest.approx(2 / 3)  # so do extra ones
    assert char_match("", "") == 1.0 and char_match("", "7") == 0.0


def test_load_reward_resolves_and_explains():
    assert load_reward("rldsl.rewards:exact_match") is exact_match
    with pytest.raises(RewardLoadError, match="expected 'module:function'"):
        load_reward("rldsl.rewards.exact_match")
    with pytest.raises(RewardLoadError, match="cannot import module 'no_such_module'"):
        load_reward("no_such_module:f")
    with pytest.raises(RewardLoadError, match="has no function 'exact_mach'; did you mean 'exact_match'"):
        load_reward("rldsl.rewards:exact_mach")
    with pytest.raises(RewardLoadError, match="not a function"):
        load_reward("math:pi")


def failing_reward(response, answer, prompt):
    raise ValueError("bad response")


def slow_reward(response, answer, prompt):
    time.sleep(2)
    return 1.0


def test_safe_reward_drops_failures_with_a_reason():
    assert safe_reward(exact_match, "19", "19", "12+7=", timeout_s=1.0) == (1.0, None)
    assert safe_reward(exact_match, "19", "19", "12+7=") == (1.0, None)
    assert safe_reward(failing_reward, "x", "y", "z", 1.0) == (None, "reward raised ValueError: bad response")
    assert safe_reward(failing_reward, "x", "y", "z") == (None, "reward raised ValueError: bad response")
    started = time.perf_counter()
    value, reason = safe_reward(slow_reward, "x", "y", "z", timeout_s=0.2)
    assert value is None and reason == "reward timed out after 0.2s"
    assert time.perf_counter() - started < 1.0
    assert safe_reward(lambda *a: math.nan, "x", "y", "z")[1] == "reward returned nan"
    assert safe_reward(lambda *a: "high", "x", "y", "z")[1] == "reward returned str, not a number"
    assert safe_reward(lambda *a: True, "x", "y", "z") == (1.0, None)


# -- tokenizer ---------------------------------------------------------------------


def test_char_tokenizer_round_trip_and_save(tmp_path):
    tokenizer = CharTokenizer()
    ids = tokenizer.encode("12+7=19", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id and tokenizer.pad_id == 0
    assert tokenizer.decode(ids) == "12+7=19"
    assert tokenizer.decode(ids + tokenizer.encode("junk")) == "12+7=19"  # stops at EOS
    assert tokenizer.encode("A") == [tokenizer.unk_id]
    tokenizer.save(tmp_path / "tok.json")
    loaded = CharTokenizer.load(tmp_path / "tok.json")
    assert loaded.encode("reverse abc:") == tokenizer.encode("reverse abc:")
    assert loaded.vocab_size == tokenizer.vocab_size
