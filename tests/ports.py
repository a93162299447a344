"""A free TCP port on loopback, for tests whose processes rendezvous over gloo."""

import socket


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn_ranks(worker, *args, nprocs: int = 2) -> dict:
    """``worker(rank, port, *args, results)`` in ``nprocs`` spawned processes
    that rendezvous on a free port; what they put in ``results``."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(worker, args=(free_port(), *args, shared), nprocs=nprocs, join=True)
        return dict(shared)
