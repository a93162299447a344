"""The collective weight transport: trainer and receivers in separate
processes, joined by a gloo group of their own (rldsl.runtime.transport)."""

from __future__ import annotations

import multiprocessing
import queue
import resource
import time
import traceback

import pytest
import torch

from rldsl.runtime.transport.group import form_group
from rldsl.runtime.transport.stream import TransportAborted, receive_buckets, send_buckets
from tests.ports import rank_context

MIB = 2**20


def _spawn(target, world: int, tmp_path, *args, context=None) -> list:
    """Run ``target(rank, store_path, *args)`` in ``world`` processes (from the fork server unless
    ``context`` says otherwise); their results by rank."""
    context = context or rank_context()
    results = context.Queue()
    store = str(tmp_path / "store")
    processes = [context.Process(target=_run, args=(target, rank, world, store, results, *args))
                 for rank in range(world)]
    for process in processes:
        process.start()
    out = _results(results, len(processes), 240, processes)
    for process in processes:
        process.join(timeout=60)
    failures = [v for v in out.values() if isinstance(v, str) and v.startswith("Traceback")]
    assert not failures, failures[0]
    return [out[rank] for rank in range(world)]


def _results(results, count: int, timeout_s: float, processes) -> dict:
    """``count`` (rank, result) pairs from ``results``; past ``timeout_s`` in all, a failure
    that says which ranks answered what and which processes still run (else lost with the hang)."""
    deadline, out = time.monotonic() + timeout_s, {}
    while len(out) < count:
        try:
            rank, result = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            running = [rank for rank, process in enumerate(processes) if process.is_alive()]
            for process in processes:
                process.kill()
            pytest.fail(f"{count - len(out)} rank(s) gave no result within {timeout_s:g}s; still running: "
                        f"{running}; answered: {out}")
        out[rank] = result
    return out


def _run(target, rank, world, store_path, results, *args):
    try:
        store = torch.distributed.FileStore(store_path, world)
        # held until the result is sent: dropping a gloo group with a transfer still pending (a receiver that
        # called a push off) waits out the group's timeout (measured: 7.5 s of an 8 s one), which is the
        # group's teardown, not what these tests time
        group = form_group(store, "edge/0", rank, world, timeout_s=120)
        results.put((rank, target(group, *args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


def _tiny(seed: int):
    from rldsl.models.tiny import build_tiny_lm

    return build_tiny_lm(seed, d_model=32, n_layers=2, n_heads=2, d_ff=64)


def _trainer_or_generator(group, bucket_bytes: int):
    """Rank 0 trains one split step and streams its weights; the others are
    generators that start from other weights and apply the stream."""
    from rldsl.runtime.control.advantages import batch_advantages
    from rldsl.runtime.engines.torch import TorchGenerator, TorchTrainer
    from rldsl.runtime.protocols import Prompt

    if group.rank == 0:
        trainer = TorchTrainer(_tiny(0), lr=1e-2)
        batch = TorchGenerator(_tiny(0), max_new_tokens=4).generate([Prompt(0, "12+7=", "19")], 4, seed=1)
        batch["advantage"] = batch_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
        trainer.begin_train_step(0)
        trainer.train_microbatch(0, batch)
        result = trainer.finish_train_step(0)
        # the weights where they are, as a push that goes only rank to rank takes them (no host copy)
        stats = send_buckets(group, trainer.weight_buckets(bucket_bytes, on_host=False), result.version)
        return {"state": _as_bytes(trainer.model.module.state_dict()), "version": result.version,
                "stats": stats.as_dict()}
    generator = TorchGenerator(_tiny(group.rank + 10), max_new_tokens=4)
    for bucket, last in receive_buckets(group, version=1):
        generator.update_weights(bucket, 1, last)
    return {"state": _as_bytes(generator.model.module.state_dict()), "version": generator.version}


def _as_bytes(state: dict) -> dict:
    """Exact contents, as plain bytes (tensors do not outlive their process through a queue)."""
    return {name: (str(t.dtype), tuple(t.shape), t.detach().cpu().numpy().tobytes()) for name, t in state.items()}


def test_a_trained_version_reaches_every_generator_bit_identical(tmp_path):
    trainer, *generators = _spawn(_trainer_or_generator, 3, tmp_path, 4096)
    assert trainer["version"] == 1 and trainer["stats"]["buckets"] > 3  # several buckets, streamed
    for generator in generators:
        assert generator["version"] == 1
        assert generator["state"].keys() == trainer["state"].keys()
        assert generator["state"] == trainer["state"]


def test_a_stream_takes_the_weights_where_they_are_and_the_object_store_a_copy():
    from rldsl.runtime.engines.torch import TorchTrainer

    trainer = TorchTrainer(_tiny(0), lr=1e-2)
    weights = {name: t.data_ptr() for name, t in trainer.model.module.state_dict().items()}
    streamed = {name: t.data_ptr() for b in trainer.weight_buckets(4096, on_host=False) for name, t in b.items()}
    stored = {name: t.data_ptr() for b in trainer.weight_buckets(4096) for name, t in b.items()}
    assert streamed == weights  # no copy: the stream packs them into its payload on the group's device
    assert stored.keys() == weights.keys() and not set(stored.values()) & set(weights.values())


def _big_model_buckets(count: int, tensor_bytes: int):
    """``count`` fp32 tensors made one at a time (what a sharded trainer's gather yields)."""
    for index in range(count):
        yield {f"layer{index}.weight": torch.full((tensor_bytes // 4,), float(index))}


def _peak_rss_growth(group, count: int, tensor_bytes: int):
    """How much this process's peak resident memory grew during one push of
    ``count`` x ``tensor_bytes`` (bucket = one tensor), and what arrived."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if group.rank == 0:
        stats = send_buckets(group, _big_model_buckets(count, tensor_bytes), version=7)
        checks = None
    else:
        checks = []
        for bucket, _ in receive_buckets(group, version=7):
            (name, tensor), = bucket.items()
            checks.append((name, float(tensor[0]), float(tensor[-1])))  # applied, then let go
        stats = None
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"grown": grown, "checks": checks, "stats": stats and stats.as_dict()}


def test_host_memory_stays_near_two_buckets_not_the_model(tmp_path, monkeypatch):
    """A 256 MiB "model" in 16 MiB buckets: neither side's peak resident
    memory grows by more than a few buckets (the object-store path holds
    the whole model on both). glibc's adaptive mmap threshold would keep
    freed buffers in the heap and let the peak measure the allocator, so the
    processes get a fixed one."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(MIB))
    count, tensor_bytes = 16, 16 * MIB
    # spawned: glibc reads the threshold when a process starts, and a fork server started without it
    sender, receiver = _spawn(_peak_rss_growth, 2, tmp_path, count, tensor_bytes,
                              context=multiprocessing.get_context("spawn"))
    assert receiver["checks"] == [(f"layer{i}.weight", float(i), float(i)) for i in range(count)]
    model = count * tensor_bytes
    assert sender["stats"]["peak_held_bytes"] <= 2 * tensor_bytes
    for side in (sender, receiver):
        assert side["grown"] < 5 * tensor_bytes < model, f"peak RSS grew {side['grown'] / MIB:.0f} MiB"


def _failing_sender(group):
    if group.rank == 0:
        def buckets():
            yield {"a": torch.ones(4)}
            raise RuntimeError("gather failed")
        with pytest.raises(RuntimeError, match="gather failed"):
            send_buckets(group, buckets(), version=3)
        return "raised"
    received = []
    try:
        for bucket, _ in receive_buckets(group, version=3):
            received.append(list(bucket))
    except TransportAborted as aborted:
        return f"aborted after {len(received)}: {aborted}"
    return "completed"


def test_a_sender_that_fails_half_way_aborts_the_receivers(tmp_path):
    sender, receiver = _spawn(_failing_sender, 2, tmp_path)
    assert sender == "raised"
    assert receiver.startswith("aborted after 0: the sender of weights version 3 failed")


def _one_receiver_dies(group, flag: str):
    """Rank 2 dies before the push; rank 0's send fails on it and calls the
    push off (here a file, in a run the rendezvous board); rank 1 returns at
    once instead of at the group's timeout: with the error itself where the
    broadcast relayed through the dead rank, else called off."""
    import os
    import time
    from pathlib import Path

    def wait_for(*names: str) -> None:
        while not all(Path(f"{flag}.{name}").exists() for name in names):
            time.sleep(0.05)

    group.should_abort = lambda: Path(flag).exists()
    Path(f"{flag}.formed{group.rank}").touch()
    if group.rank == 2:
        wait_for("formed0", "formed1")  # once every rank has its group (a loaded machine forms them late)
        Path(f"{flag}.died").touch()
        os._exit(0)
    started = time.monotonic()
    if group.rank == 0:
        wait_for("died")
        time.sleep(0.5)  # its sockets closed
        try:
            send_buckets(group, ({"x": torch.ones(2**20)} for _ in range(4)), version=5)
        except RuntimeError as error:
            Path(flag).touch()
            return f"send failed: {type(error).__name__}"
        return "sent"
    try:
        for _ in receive_buckets(group, version=5):
            pass
    except RuntimeError:  # TransportAborted, or gloo's own error
        return f"stopped after {time.monotonic() - started:.1f}s"
    return "received"


def test_a_dead_member_does_not_hold_the_others_until_the_timeout(tmp_path):
    context = rank_context()
    results, store, flag = context.Queue(), str(tmp_path / "store"), str(tmp_path / "called-off")
    processes = [context.Process(target=_run, args=(_one_receiver_dies, rank, 3, store, results, flag))
                 for rank in range(3)]
    for process in processes:
        process.start()
    out = _results(results, 2, 100, processes)  # rank 2 reports nothing
    for process in processes:
        process.join(timeout=5)
        process.kill()  # a receiver that called the push off may still be tearing its group down (see _run)
    assert out[0] == "send failed: RuntimeError"
    assert out[1].startswith("stopped after "), out[1]
    assert float(out[1].split()[-1].rstrip("s")) < 10  # the group's timeout is 120 s


def _closes_with_a_transfer_pending(rank: int, store_path: str, results) -> None:
    """Rank 1 waits on a broadcast rank 0 never sends, closes the group, and
    both form the next epoch's group and use it."""
    try:
        store = torch.distributed.FileStore(store_path, 2)
        first = form_group(store, "edge/0", rank, 2, timeout_s=8)
        closed_in = 0.0
        if rank == 1:
            pending = first.broadcast(torch.zeros(4))  # never sent: pending until the group's timeout
            time.sleep(0.2)
            started = time.monotonic()
            first.close()
            del pending
            closed_in = time.monotonic() - started
        started = time.monotonic()
        second = form_group(store, "edge/1", rank, 2, timeout_s=8)
        tensor = torch.full((4,), 7.0) if rank == 0 else torch.zeros(4)
        second.wait(second.broadcast(tensor))
        results.put((rank, (closed_in, time.monotonic() - started, tensor.tolist())))
        time.sleep(9)  # rank 0 keeps its first group until rank 1's dropped one has timed out
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


def test_closing_a_group_with_a_transfer_pending_returns_at_once_and_the_next_group_forms(tmp_path):
    context = rank_context()
    results = context.Queue()
    store = str(tmp_path / "store")
    processes = [context.Process(target=_closes_with_a_transfer_pending, args=(rank, store, results))
                 for rank in range(2)]
    for process in processes:
        process.start()
    out = _results(results, 2, 60, processes)
    for process in processes:
        process.kill()
    closed_in, next_formed_in, received = out[1]
    assert closed_in < 1.0, out  # dropping it in place waited 7.5 s of its 8 s timeout
    assert next_formed_in < 5.0 and received == [7.0] * 4, out


def test_a_wait_that_is_called_off_raises_instead_of_waiting():
    from rldsl.runtime.transport.group import WeightGroup

    class NeverCompletes:
        def is_completed(self):
            return False

    calls = []
    group = WeightGroup(None, 1, 2, torch.device("cpu"), should_abort=lambda: calls.append(1) or len(calls) > 2)
    with pytest.raises(TransportAborted, match="called off"):
        group.wait(NeverCompletes())
    assert len(calls) == 3  # asked every poll interval, not on every spin
