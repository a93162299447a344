"""fsdp checkpoints as shards (torch.distributed.checkpoint), on two ranks
over gloo: each rank writes its own shards and its host memory grows by far
less than the model and optimizer state while it does (a gathered
checkpoint needed all of it on rank 0); the checkpoint resumes bit for bit
on two ranks and on one, and `rldsl export`'s reader takes the model from
the shards in a process without a group."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from rldsl.models.tiny import build_tiny_lm
from rldsl.runtime.engines.fsdp import FsdpTrainer
from rldsl.runtime.engines.fsdp.state import read_model_state
from tests.host_memory import peak_rss, peak_rss_reset
from tests.ports import free_port, start_ranks
from tests.test_split_step_gradient import make_batch

SHAPE = {"d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 1024}  # 3.2M parameters: 38 MiB with AdamW state


def trained(seed: int = 0) -> FsdpTrainer:
    trainer = FsdpTrainer(build_tiny_lm(seed=seed, **SHAPE), lr=1e-3)
    batch = make_batch(trainer.model)
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, batch)
    trainer.finish_train_step(0)
    return trainer


def full(trainer: FsdpTrainer) -> dict:
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for name, t in trainer.model.module.state_dict().items()}


def _worker(rank: int, world_size: int, port: int, directory: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        trainer = trained()
        state_bytes = 3 * sum(p.numel() * 4 for p in trainer.model.module.parameters())  # weights + AdamW
        before = peak_rss_reset()
        started = time.perf_counter()
        trainer.save_checkpoint(directory)
        results[("save", rank)] = (peak_rss() - before, state_bytes, time.perf_counter() - started)
        expected = full(trainer)
        resumed = FsdpTrainer(build_tiny_lm(seed=1, **SHAPE), lr=1e-3)  # other weights: all must come from disk
        assert resumed.load_checkpoint(directory) == 1 and resumed.optimizer_steps == 1
        results[("resumed", rank)] = all(torch.equal(a, b) for a, b in zip(expected.values(), full(resumed).values()))
        if rank == 0:
            results["expected"] = {name: tensor.clone() for name, tensor in expected.items()}
    finally:
        dist.destroy_process_group()


def test_two_ranks_write_their_shards_and_the_checkpoint_resumes_anywhere(tmp_path):
    results = start_ranks(_worker, (2, free_port(), str(tmp_path)))
    assert results[("resumed", 0)] and results[("resumed", 1)]
    for rank in (0, 1):
        grown, state_bytes, seconds = results[("save", rank)]
        print(f"rank {rank}: saved its shards of the {state_bytes / 2**20:.0f} MiB of model and optimizer state in "
              f"{seconds:.2f} s, peak host memory +{grown / 2**20:.1f} MiB")
        assert grown < state_bytes / 4, (rank, grown, state_bytes)  # a gathered save holds all of it on rank 0
    assert sorted(path.name for path in (tmp_path / "fsdp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    model = read_model_state(tmp_path)  # here, no process group: as `rldsl export` reads it
    expected = results["expected"]
    assert model.keys() == expected.keys() and all(torch.equal(model[k], expected[k]) for k in expected)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:  # one rank takes up the two ranks' checkpoint
        alone = FsdpTrainer(build_tiny_lm(seed=1, **SHAPE), lr=1e-3)
        assert alone.load_checkpoint(tmp_path) == 1
        assert all(torch.equal(a, expected[k]) for k, a in full(alone).items())
    finally:
        dist.destroy_process_group()
