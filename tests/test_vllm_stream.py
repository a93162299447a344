"""A push streamed rank to rank into real vLLM's workers (vLLM's CPU build):
the workers join the weight group through vLLM's weight-transfer API and
load each bucket as it arrives (engines/vllm_receiver.py). This process
stands as the trainer's rank 0, as the Ray runs' trainer does
(tests/test_vllm_run.py runs it end to end)."""

from __future__ import annotations

import itertools
import threading

import pytest

from rldsl.runtime.protocols import Prompt
from rldsl.runtime.transport.group import form_group, open_store
from rldsl.runtime.transport.stream import send_buckets
from tests.vllm_engines import needs_vllm

PROMPTS = [Prompt(0, "12+7=", "19"), Prompt(1, "3+45=", "48")]
_GROUPS = itertools.count()


def _joined(engine, tmp_path):
    """A weight group of this process (rank 0) and the engine's workers."""
    name, size = f"stream#{next(_GROUPS)}", 1 + engine.weight_group_ranks
    store = f"file://{tmp_path / name.replace('#', '-')}"
    info = {"group": name, "rank_offset": 1, "size": size, "store": store, "timeout_s": 60.0,
            "called_off_file": str(tmp_path / f"{name}.called-off")}
    joining = threading.Thread(target=engine.join_weight_group, args=(info,))
    joining.start()
    group = form_group(open_store(store, size, is_master=True, timeout_s=60.0), name, 0, size, "cpu", 60.0)
    joining.join(timeout=60)
    return group, info["called_off_file"]


def _receiving(engine, version: int, called_off_file: str) -> tuple[threading.Thread, dict]:
    result = {}

    def receive():
        try:
            result["stats"] = engine.receive_stream(version, lambda: False, called_off_file)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            result["error"] = error

    thread = threading.Thread(target=receive)
    thread.start()
    return thread, result


@needs_vllm
def test_a_streamed_push_lands_in_vllms_workers_bucket_by_bucket_with_vllms_version(vllm_engine, tmp_path):
    from rldsl.runtime.engines.torch.common import tensor_buckets

    engine = vllm_engine.generator
    assert engine.joins_weight_groups and engine.weight_group_ranks == 1
    group, called_off = _joined(engine, tmp_path)
    model = vllm_engine.scaled_reference(1.1)
    try:
        vllm_engine.version += 1
        thread, result = _receiving(engine, vllm_engine.version, called_off)
        sent = send_buckets(group, tensor_buckets(model.module.state_dict().items(), 1 << 15), vllm_engine.version)
        thread.join(timeout=60)
        stats = result["stats"]
        assert stats["buckets"] == sent.buckets > 4 and stats["bytes"] == sent.bytes and stats["workers"] == 1
        largest = max(t.numel() * t.element_size() for t in model.module.state_dict().values())
        assert stats["peak_held_bytes"] <= max(1 << 15, largest) < sent.bytes / 8  # a bucket at a time
        assert engine.llm.current_version() == vllm_engine.version == engine.version
        batch = engine.generate(PROMPTS, samples_per_prompt=4, seed=1)
        assert batch["version"].tolist() == [vllm_engine.version] * 8
        assert vllm_engine.behaviour_gap(model, batch) < 1e-4
    finally:
        group.close()
        vllm_engine.restore_weights()


def _failing_buckets(state: dict):
    from rldsl.runtime.engines.torch.common import tensor_buckets

    for index, bucket in enumerate(tensor_buckets(state.items(), 1 << 15)):
        if index == 3:
            raise RuntimeError("the trainer failed half way")
        yield bucket


@needs_vllm
def test_a_push_that_fails_half_way_keeps_vllm_from_sampling_until_a_whole_version_lands(vllm_engine, tmp_path):
    engine = vllm_engine.generator
    group, called_off = _joined(engine, tmp_path)
    model = vllm_engine.scaled_reference(0.9)
    try:
        vllm_engine.version += 1
        thread, result = _receiving(engine, vllm_engine.version, called_off)
        with pytest.raises(RuntimeError, match="half way"):
            send_buckets(group, _failing_buckets(model.module.state_dict()), vllm_engine.version)
        thread.join(timeout=60)
        assert "failed during the push" in str(result.get("error")), result  # vLLM's worker heard the abort
        with pytest.raises(RuntimeError, match="in progress"):  # three buckets of it are in the model
            engine.generate(PROMPTS, samples_per_prompt=1, seed=1)
        # what follows a failed push: the same version through the object store, whole
        version = vllm_engine.version
        vllm_engine.version -= 1
        assert vllm_engine.push(model.module.state_dict()) == version
        batch = engine.generate(PROMPTS, samples_per_prompt=2, seed=1)
        assert batch["version"].tolist() == [version] * 4
    finally:
        group.close()
        vllm_engine.restore_weights()


@needs_vllm
def test_between_requests_the_workers_receive_once_the_groups_in_flight_have_ended(vllm_engine, tmp_path):
    from rldsl.runtime.engines.batch_requests import token_version_runs
    from rldsl.runtime.engines.batching import ContinuousBatcher
    from rldsl.runtime.engines.torch.common import tensor_buckets

    batcher = ContinuousBatcher(vllm_engine.generator, update="between_requests")
    batcher.engine = long_generator = vllm_engine.long_generator(max_new_tokens=60)
    group, called_off = _joined(long_generator, tmp_path)
    model = vllm_engine.scaled_reference(1.05)
    results = {}
    decoding = threading.Thread(target=lambda: results.update(batch=batcher.submit(PROMPTS[:1], 4, 5)))
    try:
        decoding.start()
        vllm_engine.wait_for_tokens(20)  # the group is decoding
        vllm_engine.version += 1
        receiving = threading.Thread(target=lambda: results.update(stats=batcher.swap_in_engine(
            lambda engine: engine.receive_stream(vllm_engine.version, lambda: False, called_off))))
        receiving.start()
        send_buckets(group, tensor_buckets(model.module.state_dict().items(), 1 << 16), vllm_engine.version)
        receiving.join(timeout=60)
        decoding.join(timeout=60)
        batch = results["batch"]
        assert batch["response_mask"].sum(dim=1).tolist() == [60] * 4
        assert not token_version_runs(batch.get("token_versions"), batch["response_mask"])  # one version each
        assert batch["version"].tolist() == [vllm_engine.version - 1] * 4  # the weights it started with
        assert batcher.stats()["weight_swaps"] == 1 and batcher.stats()["interrupts"] == 0
        assert results["stats"]["workers"] == 1 and long_generator.version == vllm_engine.version
    finally:
        batcher.close()
        group.close()
        vllm_engine.restore_weights()
