"""Process groups whose ranks may sit on different nodes.

Rank 0 of a group picks its own node's address and a free port there and
publishes them on a small named actor (the board, one per run); the other
ranks read them from it. Every rank first signs in on the board, so a
rendezvous that times out names the group and the ranks that never came.

A local run (every rank on this machine) meets in a file instead
(``store_dir``): torch's TCP store would listen on every interface, a file
store opens no socket at all.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

BOARD_NAME = "rendezvous"
TIMEOUT_ENV = "RLDSL_RENDEZVOUS_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
COLLECTIVE_TIMEOUT_ENV = "RLDSL_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0  # a step's slowest collective on a big model, with room
_POLL_S = 0.05


class RendezvousTimeout(RuntimeError):
    """A process group did not form in time."""


class CollectiveTimeout(RuntimeError):
    """A collective of a formed group did not complete in time: a rank hangs or died."""


class RendezvousBoard:
    """Addresses of the run's process groups and which ranks have arrived;
    a Ray actor (``create_board``)."""

    def __init__(self) -> None:
        self._addresses: dict[str, str] = {}
        self._arrived: dict[str, set[int]] = {}
        self._called_off: set[str] = set()

    def arrive(self, group: str, rank: int) -> None:
        self._arrived.setdefault(group, set()).add(rank)

    def publish(self, group: str, address: str) -> None:
        self._addresses[group] = address

    def address(self, group: str) -> str | None:
        return self._addresses.get(group)

    def arrived(self, group: str) -> list[int]:
        return sorted(self._arrived.get(group, ()))

    def call_off(self, group: str) -> None:
        """A transfer in ``group`` failed somewhere: its members stop waiting for it."""
        self._called_off.add(group)

    def called_off(self, group: str) -> bool:
        return group in self._called_off


def create_board():
    """The run's board, named so every worker finds it in the run's namespace."""
    import ray

    return ray.remote(RendezvousBoard).options(name=BOARD_NAME, num_cpus=0).remote()


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def join_process_group(group: str, rank: int, world_size: int, store_dir: str | None = None):
    """Join ``group`` as ``rank`` of ``world_size`` (gloo on CPU, NCCL for CUDA
    tensors when there is a GPU); returns torch's default group. With
    ``store_dir`` the ranks meet in a file there (one machine only)."""
    import torch
    import torch.distributed as dist

    board, deadline, limit = _arrive(group, rank)
    init_method, address = _meeting_point(board, group, rank, world_size, store_dir, deadline, limit)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except (RuntimeError, ValueError) as err:  # torch raises DistStoreError (a RuntimeError) on timeout
        raise RendezvousTimeout(_missing(board, group, world_size, limit, address, err)) from None
    _set_collective_timeout(dist)
    return dist.group.WORLD


def group_store(group: str, rank: int, world_size: int, store_dir: str | None = None):
    """A store every rank of ``group`` shares, for a group built beside the
    default one (a weight group): a file in ``store_dir`` locally, else a TCP
    store hosted by rank 0 at the address it publishes on the board."""
    from rldsl.runtime.transport.group import open_store

    board, deadline, limit = _arrive(group, rank)
    init_method, address = _meeting_point(board, group, rank, world_size, store_dir, deadline, limit)
    try:
        return open_store(init_method, world_size, rank == 0, deadline - time.monotonic())
    except (RuntimeError, ValueError) as err:
        raise RendezvousTimeout(_missing(board, group, world_size, limit, address, err)) from None


def store_address(group: str, ranks: range, world_size: int, store_dir: str | None = None) -> str:
    """Where the store of ``group`` is (``file://`` or ``tcp://``), for
    ``ranks`` that open it in processes outside Ray (a vLLM replica's
    workers): they are signed in on the board here; rank 0 is never among
    them, it hosts the store."""
    import ray

    if 0 in ranks:
        raise ValueError("rank 0 of a weight group hosts its store and opens it itself (group_store)")
    board, deadline, limit = _arrive(group, ranks[0])
    ray.get([board.arrive.remote(group, rank) for rank in ranks[1:]])
    return _meeting_point(board, group, ranks[0], world_size, store_dir, deadline, limit)[0]


def _arrive(group: str, rank: int):
    """Sign in on the board; returns it, the rendezvous deadline and its length."""
    import ray

    board = ray.get_actor(BOARD_NAME)
    ray.get(board.arrive.remote(group, rank))
    limit = timeout_s()
    return board, time.monotonic() + limit, limit


def _meeting_point(board, group: str, rank: int, world_size: int, store_dir: str | None, deadline: float,
                   limit: float) -> tuple[str, str]:
    """``(init_method, address)``: a file in ``store_dir``, or rank 0's address and a free port there."""
    import ray

    if store_dir is not None:
        address = str(Path(store_dir) / group.replace("/", "_"))
        return f"file://{address}", address
    if rank == 0:
        address = f"{_host()}:{_free_port()}"
        ray.get(board.publish.remote(group, address))
    else:
        address = _wait_for_address(board, group, world_size, deadline, limit)
    return f"tcp://{address}", address


def collective_timeout_s() -> float:
    return float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S))


def _set_collective_timeout(dist) -> None:
    """The group formed within what was left of the rendezvous deadline, and
    torch keeps that as every collective's timeout: give collectives their
    own. torch has no public setter; without it the rendezvous value stays."""
    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timedelta(seconds=collective_timeout_s()), dist.group.WORLD)


@contextlib.contextmanager
def collectives_named(group: str, rank: int, world_size: int):
    """A collective that times out says which group, which rank and how long."""
    try:
        yield
    except RuntimeError as err:
        if "timed out" not in str(err).lower() and "timeout" not in type(err).__name__.lower():
            raise
        raise CollectiveTimeout(f"a collective of process group `{group}` timed out on rank {rank} of {world_size} "
                                f"after {collective_timeout_s():g}s ({RuntimeError.__str__(err).splitlines()[0]}); "
                                f"another rank hangs or died ({COLLECTIVE_TIMEOUT_ENV} sets the limit)") from None


def _wait_for_address(board, group: str, world_size: int, deadline: float, limit: float) -> str:
    import ray

    while time.monotonic() < deadline:
        address = ray.get(board.address.remote(group))
        if address:
            return address
        time.sleep(_POLL_S)
    raise RendezvousTimeout(_missing(board, group, world_size, limit))


def _missing(board, group: str, world_size: int, limit: float, address: str | None = None,
             error: BaseException | None = None) -> str:
    import ray

    arrived = set(ray.get(board.arrived.remote(group)))
    missing = [r for r in range(world_size) if r not in arrived]
    if missing:
        return (f"process group `{group}` did not form within {limit:g} s: rank(s) {missing} of {world_size} never "
                "arrived (their actors did not start, or hang before joining)")
    return (f"process group `{group}` did not form within {limit:g} s: all {world_size} ranks arrived but could not "
            f"all connect to rank 0 at {address} ({type(error).__name__}: {error}); check that the nodes can reach "
            "each other on that address and port")


def _host() -> str:
    """This node's address as Ray knows it (loopback when Ray runs on loopback)."""
    import ray

    return ray.util.get_node_ip_address()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((_host(), 0))
        return sock.getsockname()[1]
