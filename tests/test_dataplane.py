"""The data-plane contract, run against every backend.

The Ray backends share one local Ray (and one TransferQueue) per module;
each test writes to its own partition so tests cannot see each other's rows.
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

from rldsl.runtime.dataplane import (  # noqa: E402
    InMemoryDataPlane,
    MissingDataError,
    connect_dataplane,
    parse_sample_key,
    sample_key,
)

BACKENDS = [
    "memory",
    pytest.param("ray", marks=pytest.mark.ray),
    pytest.param("transferqueue", marks=pytest.mark.ray),
]


@pytest.fixture(scope="module")
def ray_cluster():
    """The session's Ray and its TransferQueue (tests/runs.py)."""
    pytest.importorskip("ray")
    from tests.runs import shared_ray

    return shared_ray()


@pytest.fixture(scope="module")
def shared_planes(ray_cluster):
    """Backend name -> plane, created on first use, closed before Ray stops."""
    planes = {}
    yield planes
    for plane in planes.values():
        plane.close()


@pytest.fixture(params=BACKENDS)
def plane(request):
    if request.param == "memory":
        with InMemoryDataPlane() as memory_plane:
            yield memory_plane
        return
    planes = request.getfixturevalue("shared_planes")
    if request.param not in planes:
        if request.param == "transferqueue":
            pytest.importorskip("transfer_queue")
        planes[request.param] = connect_dataplane({"backend": request.param})
    yield planes[request.param]


@pytest.fixture
def partition(request):
    return request.node.name


def left_padded(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([[0] * (width - len(r)) + r for r in rows])


def right_padded(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def rollout_batch(prompts, responses, rewards, prompt_width, response_width):
    """Fields as a generator writes them: prompts left-, responses right-padded."""
    return {
        "prompt_ids": left_padded(prompts, prompt_width),
        "prompt_mask": left_padded([[1] * len(p) for p in prompts], prompt_width),
        "response_ids": right_padded(responses, response_width),
        "response_mask": right_padded([[1] * len(r) for r in responses], response_width),
        "behaviour_logprobs": right_padded(responses, response_width).float() * -0.5,
        "reward": torch.tensor(rewards, dtype=torch.float32),
    }


FIELDS = ["prompt_ids", "prompt_mask", "response_ids", "response_mask", "behaviour_logprobs", "reward"]


def assert_same(actual: dict, expected: dict):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(actual[name], expected[name]), f"{name}: {actual[name]} != {expected[name]}"


def test_round_trip_with_ragged_rows(plane, partition):
    keys = [sample_key("pipe", 0, s) for s in range(3)]
    batch = rollout_batch([[5, 6], [7], [8, 9, 4]], [[11], [12, 13, 14, 2], [15, 2]], [1.0, 0.0, 0.5], 4, 5)
    plane.put(keys, partition, batch, tags=[{"version": 0}] * 3)
    assert_same(plane.get(keys, partition, FIELDS), batch)


def test_rows_from_puts_of_different_widths_are_padded_per_field_side(plane, partition):
    narrow = rollout_batch([[5, 6]], [[11, 2]], [1.0], prompt_width=3, response_width=2)
    wide = rollout_batch([[7, 8, 9, 10]], [[12, 13, 14, 2]], [0.0], prompt_width=5, response_width=6)
    plane.put(["narrow"], partition, narrow)
    plane.put(["wide"], partition, wide)
    got = plane.get(["narrow", "wide"], partition, FIELDS)
    expected = rollout_batch([[5, 6], [7, 8, 9, 10]], [[11, 2], [12, 13, 14, 2]], [1.0, 0.0], 5, 6)
    assert_same(got, expected)


def test_get_preserves_key_order(plane, partition):
    keys = [sample_key("pipe", p, s) for p in range(3) for s in range(2)]
    rewards, responses = torch.arange(6, dtype=torch.float32), torch.arange(12).view(6, 2)
    plane.put(keys, partition, {"reward": rewards, "response_ids": responses})
    order = [4, 0, 5, 2, 1, 3]
    got = plane.get([keys[i] for i in order], partition, ["reward", "response_ids"])
    assert got["reward"].tolist() == [float(i) for i in order]
    assert got["response_ids"].tolist() == [[2 * i, 2 * i + 1] for i in order]


def test_fields_subset_and_fields_written_later(plane, partition):
    keys = ["a", "b", "c"]
    plane.put(keys, partition, rollout_batch([[1], [2], [3]], [[4], [5], [6]], [0.0, 0.0, 0.0], 1, 1))
    assert list(plane.get(keys, partition, ["reward"])) == ["reward"]
    plane.put(["a", "b"], partition, {"advantage": torch.tensor([0.5, -0.5])})
    assert plane.get(["b", "a"], partition, ["advantage"])["advantage"].tolist() == [-0.5, 0.5]
    with pytest.raises(MissingDataError) as error:
        plane.get(keys, partition, ["advantage", "reward"])
    assert error.value.missing_fields == ["advantage"] and error.value.missing_keys == []


def test_writing_a_field_again_replaces_it_and_tags_merge(plane, partition):
    plane.put(["a"], partition, {"response_ids": torch.tensor([[1, 2, 3]])}, tags=[{"version": 0}])
    plane.put(["a"], partition, {"response_ids": torch.tensor([[7]])}, tags=[{"reward_done": True}])
    assert plane.get(["a"], partition, ["response_ids"])["response_ids"].tolist() == [[7]]
    assert plane.list_tags(partition) == {"a": {"version": 0, "reward_done": True}}


def test_trailing_dimensions_survive(plane, partition):
    pairs = torch.arange(12, dtype=torch.float32).view(2, 3, 2)
    plane.put(["a", "b"], partition, {"pairs": pairs, "prompt_ids": pairs})
    plane.put(["short"], partition, {"pairs": -torch.ones(1, 1, 2), "prompt_ids": -torch.ones(1, 1, 2)})
    assert torch.equal(plane.get(["a", "b"], partition, ["pairs"])["pairs"], pairs)
    got = plane.get(["short", "a"], partition, ["pairs", "prompt_ids"])
    assert got["pairs"].tolist() == [[[-1, -1], [0, 0], [0, 0]], pairs[0].tolist()]
    assert got["prompt_ids"].tolist() == [[[0, 0], [0, 0], [-1, -1]], pairs[0].tolist()]


def test_list_and_clear(plane, partition):
    keys = [sample_key("pipe", 7, s) for s in range(4)]
    plane.put(keys, partition, {"reward": torch.zeros(4)})
    assert sorted(plane.list(partition)) == sorted(keys)
    assert plane.list("never-written-" + partition) == []
    plane.clear(keys[:2] + ["not-there"], partition)
    assert sorted(plane.list(partition)) == sorted(keys[2:])
    with pytest.raises(MissingDataError):
        plane.get(keys[:1], partition, ["reward"])
    assert plane.get(keys[2:], partition, ["reward"])["reward"].tolist() == [0.0, 0.0]


def test_missing_keys_are_named(plane, partition):
    plane.put(["here"], partition, {"reward": torch.ones(1)})
    with pytest.raises(MissingDataError) as error:
        plane.get(["here", "gone", "also-gone"], partition, ["reward"])
    assert error.value.missing_keys == ["gone", "also-gone"]
    assert "gone" in str(error.value) and partition in str(error.value)
    with pytest.raises(MissingDataError):
        plane.get(["here"], "no-such-partition-" + partition, ["reward"])


def test_bad_calls_are_rejected(plane, partition):
    with pytest.raises(ValueError, match="rows"):
        plane.put(["a", "b"], partition, {"reward": torch.zeros(3)})
    with pytest.raises(ValueError, match="unique"):
        plane.put(["a", "a"], partition, {"reward": torch.zeros(2)})
    with pytest.raises(ValueError):
        plane.get([], partition, ["reward"])
    assert plane.list(partition) == []


def test_sample_keys_are_unique_and_parse_back():
    keys = {sample_key(pipeline, p, s) for pipeline in ("grpo", "grpo2") for p in range(20) for s in range(20)}
    assert len(keys) == 2 * 20 * 20
    assert parse_sample_key(sample_key("grpo", 12, 3)) == ("grpo", 12, 3)
    with pytest.raises(ValueError):
        sample_key("a/b", 0, 0)
    with pytest.raises(ValueError):
        parse_sample_key("grpo/12/3")


def test_connect_dataplane_specs():
    plane = InMemoryDataPlane(left_padded_fields=["prompt_ids"])
    again = connect_dataplane(plane.spec)
    assert isinstance(again, InMemoryDataPlane) and again.left_padded_fields == {"prompt_ids"}
    with pytest.raises(ValueError, match="unknown data-plane backend"):
        connect_dataplane({"backend": "s3"})
    with pytest.raises(ValueError, match="unknown option"):
        connect_dataplane({"backend": "memory", "storage_units": 2})


# Runs in a fresh interpreter: the suite's own process imported torch._dynamo long ago.
_IMPORT_WITHOUT_DYNAMO = """
import sys, torch.compiler
marks = torch.compiler.allow_in_graph, torch.compiler.assume_constant_result
from rldsl.runtime.dataplane.transferqueue import import_transferqueue_module
import_transferqueue_module()
assert "tensordict" in sys.modules and "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
assert (torch.compiler.allow_in_graph, torch.compiler.assume_constant_result) == marks, "marks not restored"
import torch
from tensordict import TensorDict
rows = TensorDict({"ids": torch.arange(6).view(3, 2)}, batch_size=[3])
assert rows[1]["ids"].tolist() == [2, 3]
from rldsl.runtime.dataplane.transferqueue import _dense_from_nested, _dynamic_marks_skipped
with _dynamic_marks_skipped():  # what a get does with the jagged tensors TransferQueue builds
    ragged = torch.nested.as_nested_tensor([torch.ones(2, 2), torch.ones(3, 2)], layout=torch.jagged)
    even = torch.nested.as_nested_tensor([torch.arange(2), torch.arange(2, 4)], layout=torch.jagged)
    rows = _dense_from_nested(ragged, pad_left=True), _dense_from_nested(even, pad_left=False)
assert "torch._dynamo" not in sys.modules, "a get imported torch._dynamo"
assert rows[0][0].tolist() == [[0, 0], [1, 1], [1, 1]] and rows[1].tolist() == [[0, 1], [2, 3]]
assert torch._dynamo.mark_dynamic.__module__.startswith("torch._dynamo")  # the real one, for anyone after
with _dynamic_marks_skipped():
    assert torch._dynamo.config.__name__ == "torch._dynamo.config"  # beyond the mark: the real module
"""


def test_transfer_queue_imports_and_reads_without_torch_dynamo():
    """The import every actor of a run makes skips tensordict's torch.compile marks, and a get the dynamic
    marks of the nested tensors it turns into dense rows (each about 1 s of CPU and 140 MB)."""
    import subprocess
    import sys

    pytest.importorskip("transfer_queue")
    done = subprocess.run([sys.executable, "-c", _IMPORT_WITHOUT_DYNAMO], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
