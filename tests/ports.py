"""Processes for tests whose ranks rendezvous over gloo: a free TCP port on
loopback, and ranks started from a fork server.

A rank started the way ``torch.multiprocessing.spawn`` starts it is a fresh
interpreter that imports torch, transformers and megatron-core again (2-5 s of
CPU each on 2 cores, every rank of every test). Here multiprocessing's fork
server imports them once per test session (``RANK_PRELOAD``) and each rank,
and the manager that collects their results, is forked from it: a clean,
single-threaded process, unlike the test process (Ray, vLLM and torch
threads), which is why ranks are not forked from that. A rank sees the
environment the fork server started with; a test that sets a variable for
its ranks starts them with ``multiprocessing.get_context("spawn")``."""

import multiprocessing
import socket

RANK_PRELOAD = ("torch", "torch.distributed", "transformers", "megatron.core")  # absent ones are skipped


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_context():
    """multiprocessing's fork-server context, its server preloading ``RANK_PRELOAD`` (from its first use)."""
    multiprocessing.set_forkserver_preload(list(RANK_PRELOAD))
    return multiprocessing.get_context("forkserver")


def start_ranks(worker, args: tuple, nprocs: int = 2) -> dict:
    """``worker(rank, *args, results)`` in ``nprocs`` processes, as
    ``torch.multiprocessing.spawn`` runs it (a rank's exception fails the
    call, with its traceback); what the ranks put in ``results``."""
    import torch.multiprocessing as mp

    with rank_context().Manager() as manager:
        results = manager.dict()
        mp.start_processes(worker, args=(*args, results), nprocs=nprocs, join=True, start_method="forkserver")
        return dict(results)


def spawn_ranks(worker, *args, nprocs: int = 2) -> dict:
    """``worker(rank, port, *args, results)`` in ``nprocs`` processes that
    rendezvous on a free port; what they put in ``results``."""
    return start_ranks(worker, (free_port(), *args), nprocs)
