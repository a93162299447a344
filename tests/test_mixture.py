"""Dataset mixtures: the training prompt stream drawn from several sources."""

import itertools
import json
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from rldsl.plan import DatasetPlan
from rldsl.runtime.control.prompts import prompt_stream, train_prompt_count
from rldsl.tasks import DatasetError, load_dataset


def dataset(source: str = "builtin:arith", name: str = "prompts", **options):
    """All the prompt stream reads of a pipeline: its one dataset."""
    return SimpleNamespace(datasets=[DatasetPlan(name, source, options)])


def jsonl(path, rows: int, tag: str) -> str:
    path.write_text("".join(json.dumps({"prompt": f"{tag}{i}", "answer": str(i)}) + "\n" for i in range(rows)))
    return f"jsonl:{path}"


def take(pipe, count: int, seed: int = 0, **resume):
    return list(itertools.islice(prompt_stream(pipe, seed, **resume), count))


def test_a_single_source_streams_as_before_mixtures():
    rows = load_dataset("builtin:arith", "train", seed=3)
    order = list(range(len(rows)))
    random.Random(3).shuffle(order)  # the first epoch's order has always been Random(seed + epoch)
    stream = take(dataset(), 5, seed=3)
    assert [p.text for p in stream] == [rows[i].text for i in order[:5]]
    assert [p.index for p in stream] == [0, 1, 2, 3, 4]
    assert all(p.meta["source"] == "builtin:arith" for p in stream)


def test_draws_follow_the_weights():
    pipe = dataset(sources=["builtin:arith", "builtin:reverse"], weights=[3.0, 1.0])
    counts = Counter(p.meta["source"] for p in take(pipe, 4000))
    assert counts["builtin:arith"] / 4000 == pytest.approx(0.75, abs=0.03)  # about 4 standard deviations
    assert counts["builtin:arith"] + counts["builtin:reverse"] == 4000


def test_weights_default_to_equal_and_a_zero_weight_is_never_drawn(tmp_path):
    a, b = jsonl(tmp_path / "a.jsonl", 5, "a"), jsonl(tmp_path / "b.jsonl", 5, "b")
    counts = Counter(p.meta["source"] for p in take(dataset(a, sources=[a, b]), 4000))
    assert counts[a] / 4000 == pytest.approx(0.5, abs=0.03)
    never = take(dataset(a, sources=[a, b], weights=[0.0, 2.0]), 500)
    assert {p.meta["source"] for p in never} == {b}


def test_the_stream_is_deterministic_for_a_seed():
    pipe = dataset(sources=["builtin:arith", "builtin:reverse"], weights=[1.0, 1.0])
    first, again, other = take(pipe, 300), take(pipe, 300), take(pipe, 300, seed=1)
    assert first == again
    assert [p.text for p in first] != [p.text for p in other]
    assert [p.index for p in first] == list(range(300))


def test_a_resumed_stream_skips_exactly_the_trained_indices():
    pipe = dataset(sources=["builtin:arith", "builtin:reverse"], weights=[2.0, 1.0])
    full = take(pipe, 400)
    trained_above = frozenset({120, 121, 250})
    resumed = take(pipe, 400 - 100 - 3, trained_below=100, trained_above=trained_above)
    assert resumed == [p for p in full if p.index >= 100 and p.index not in trained_above]


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_source_goes_through_its_own_epochs(tmp_path, shuffle):
    a, b = jsonl(tmp_path / "a.jsonl", 3, "a"), jsonl(tmp_path / "b.jsonl", 5, "b")
    stream = take(dataset(a, sources=[a, b], weights=[1.0, 1.0], shuffle=shuffle), 400)
    for source, size in ((a, 3), (b, 5)):
        texts = [p.text for p in stream if p.meta["source"] == source]
        epochs = [texts[i:i + size] for i in range(0, len(texts) - size + 1, size)]
        assert len(epochs) > 10 and all(sorted(epoch) == sorted(epochs[0]) for epoch in epochs)
        assert (len({tuple(e) for e in epochs}) > 1) == shuffle  # reshuffled each epoch, or file order


def test_the_prompt_count_of_one_epoch_sums_the_sources(tmp_path):
    a, b = jsonl(tmp_path / "a.jsonl", 3, "a"), jsonl(tmp_path / "b.jsonl", 5, "b")
    assert train_prompt_count(dataset(a), seed=0) == 3
    assert train_prompt_count(dataset(a, sources=[a, b], weights=[1.0, 4.0]), seed=0) == 8
    assert train_prompt_count(dataset(a, sources=[a, b], weights=[0.0, 4.0]), seed=0) == 5  # never drawn
    arith = len(load_dataset("builtin:arith", "train", seed=0))
    assert train_prompt_count(dataset(sources=["builtin:arith", a]), seed=0) == arith + 3


def test_an_unreadable_source_is_named(tmp_path):
    absent = f"jsonl:{tmp_path}/absent.jsonl"
    with pytest.raises(DatasetError, match=r"dataset 'prompts': .*absent\.jsonl"):
        take(dataset(sources=["builtin:arith", absent]), 1)
    with pytest.raises(DatasetError, match=r"dataset 'prompts': .*'builtin:chess'"):
        train_prompt_count(dataset(sources=["builtin:arith", "builtin:chess"]), seed=0)


def test_malformed_weights_are_refused():
    with pytest.raises(DatasetError, match="1 weights for 2 sources"):
        take(dataset(sources=["builtin:arith", "builtin:reverse"], weights=[1.0]), 1)
    with pytest.raises(DatasetError, match="not all 0"):
        take(dataset(sources=["builtin:arith"], weights=[0.0]), 1)
