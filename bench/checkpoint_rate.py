"""fsdp checkpoints: sharded (each rank writes its own shards) against
gathered (rank 0 collects the whole state and writes one file, as before),
side by side in one run, on ranks over gloo.

    python bench/checkpoint_rate.py [--ranks 2] [--d-model 1024] [--layers 4] [--reps 3]

Each rank trains one step of a builtin-shaped model (so AdamW state exists),
then saves both ways, alternating, into a temporary directory. Printed: the
model and optimizer state's bytes, seconds per checkpoint (median), the rate
(state bytes / seconds) and each rank's peak host memory growth while
saving; then the time a checkpoint of 7B and 70B models would take at the
measured sharded rate per rank, for 8 and 64 ranks, against the 30 s a
SIGTERM grace gives (fp32 weights and AdamW: 12 bytes a parameter).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.host_memory import peak_rss, peak_rss_reset  # noqa: E402

GRACE_S = 30.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def one_step(trainer) -> None:
    """A step on random rows, so that AdamW holds its state."""
    vocab, rows = trainer.model.tokenizer.vocab_size, 4
    generator = torch.Generator().manual_seed(0)
    batch = {"prompt_ids": torch.randint(4, vocab, (rows, 6), generator=generator),
             "prompt_mask": torch.ones(rows, 6, dtype=torch.long),
             "response_ids": torch.randint(4, vocab, (rows, 6), generator=generator),
             "response_mask": torch.ones(rows, 6, dtype=torch.long),
             "behaviour_logprobs": torch.full((rows, 6), -3.0), "advantage": torch.randn(rows, generator=generator)}
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, batch)
    trainer.finish_train_step(0)


def gathered_save(trainer, directory: str) -> None:
    """The earlier checkpoint: the full state gathered to rank 0's host memory, one file."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from rldsl.runtime.atomic import save_torch_state

    model, optimizer = get_state_dict(trainer.model.module, trainer.optimizer,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        save_torch_state(Path(directory) / "fsdp.pt", {"model": model, "optimizer": optimizer})
    dist.barrier()


def worker(rank: int, ranks: int, port: int, shape: dict, reps: int, root: str, results) -> None:
    from rldsl.models.tiny import build_tiny_lm
    from rldsl.runtime.engines.fsdp import FsdpTrainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    torch.set_num_threads(1)
    try:
        trainer = FsdpTrainer(build_tiny_lm(seed=0, **shape), lr=1e-4)
        one_step(trainer)
        state_bytes = 3 * sum(p.numel() * 4 for p in trainer.model.module.parameters())
        ways = {"sharded": trainer.save_checkpoint, "gathered": lambda d: gathered_save(trainer, d)}
        rows = {name: [] for name in ways}
        for rep in range(reps):
            for name, save in ways.items():
                directory = Path(root) / f"{name}-{rep}"  # one directory for every rank, as a run's
                dist.barrier()
                before = peak_rss_reset()
                started = time.perf_counter()
                save(directory)
                rows[name].append((time.perf_counter() - started, peak_rss() - before))
        results[rank] = (state_bytes, {name: (statistics.median(s for s, _ in r), max(m for _, m in r))
                                       for name, r in rows.items()})
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    shape = {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 8, "d_ff": 4 * args.d_model}
    with mp.Manager() as manager, tempfile.TemporaryDirectory(prefix="rldsl-ckpt-") as root:
        results = manager.dict()
        mp.spawn(worker, args=(args.ranks, free_port(), shape, args.reps, root, results), nprocs=args.ranks,
                 join=True)
        results = dict(results)
    state_bytes = results[0][0]
    print(f"{args.ranks} ranks, model and AdamW state {state_bytes / 2**20:.0f} MiB, median of {args.reps}")
    print(f"{'checkpoint':<10} {'s':>7} {'MB/s':>8}  " + "  ".join(f"rank {r} +RSS" for r in range(args.ranks)))
    for name in ("sharded", "gathered"):
        seconds = max(results[r][1][name][0] for r in range(args.ranks))
        grown = "  ".join(f"{results[r][1][name][1] / 2**20:>8.0f}MiB" for r in range(args.ranks))
        print(f"{name:<10} {seconds:>7.3f} {state_bytes / seconds / 1e6:>8.0f}  {grown}")
    per_rank = state_bytes / args.ranks / max(results[r][1]["sharded"][0] for r in range(args.ranks))
    print(f"sharded rate per rank: {per_rank / 1e6:.0f} MB/s (this machine's disk, {args.ranks} ranks writing at once)")
    for params, label in ((7e9, "7B"), (70e9, "70B")):
        for ranks in (8, 64):
            seconds = params * 12 / ranks / per_rank
            verdict = "inside" if seconds <= GRACE_S else "past"
            print(f"  {label} on {ranks} ranks: {seconds:.0f} s per checkpoint at that rate ({verdict} a {GRACE_S:.0f} s "
                  "SIGTERM grace)")


if __name__ == "__main__":
    main()
