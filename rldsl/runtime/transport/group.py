"""A process group beside the default one, built straight from a store.

``torch.distributed.init_process_group`` allows one default group per
process, and ``new_group`` only subsets of it; a trainer rank and the
generator workers it feeds are in no common default group. So the weight
group is constructed directly (gloo's or NCCL's own class over a store,
under a prefix naming the edge and the group's epoch) and driven through
its methods, not through the functional API, which knows only groups made
by ``new_group``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist


_ABORT_POLL_S = 0.05


class TransportAborted(RuntimeError):
    """A push did not complete: the sender failed half way, or the push was
    called off because another member failed."""


@dataclass
class WeightGroup:
    """One formed group: this process's rank, the size, the device its
    tensors live on. ``should_abort``, when given, is asked while a
    transfer waits: a member that died leaves the others waiting on a
    socket until the group's timeout, so whoever notices calls the push off."""

    process_group: object
    rank: int
    size: int
    device: torch.device
    should_abort: Callable[[], bool] | None = None

    def wait(self, work) -> None:
        """Until ``work`` completes (its error raised), or the push is called off."""
        if self.should_abort is not None:
            next_check = 0.0
            while not work.is_completed():
                if time.monotonic() >= next_check:
                    if self.should_abort():
                        raise TransportAborted("the push was called off: another member of the weight group failed")
                    next_check = time.monotonic() + _ABORT_POLL_S
                time.sleep(0.001)
        work.wait()

    def close(self) -> None:
        """Let go of the group at once, even with a transfer still pending in
        it (a member died mid-push). NCCL's ``abort()`` ends the pending
        work. Gloo cannot end it: its group's destructor waits the pending
        work out to the group's timeout (measured: 7.5 s of 8 s), so the last
        reference is dropped on a thread of its own, not in the caller."""
        group, self.process_group = self.process_group, None
        if group is None:
            return
        if self.device.type == "cuda":
            group.abort()
            return
        holder = [group]
        del group
        threading.Thread(target=holder.clear, name="weight-group-drop", daemon=True).start()

    def broadcast(self, tensor: torch.Tensor):
        """Rank 0's ``tensor`` into everyone's; returns the pending work (``.wait()`` it)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.process_group.broadcast([tensor], options)


def open_store(store: str, world_size: int, is_master: bool, timeout_s: float):
    """The store of a group's rendezvous, by its address: ``file://PATH``
    (every rank on one machine) or ``tcp://HOST:PORT`` (hosted by rank 0,
    ``is_master``)."""
    if store.startswith("file://"):
        return dist.FileStore(store.removeprefix("file://"), world_size)
    host, port = store.removeprefix("tcp://").rsplit(":", 1)
    return dist.TCPStore(host, int(port), world_size, is_master=is_master, wait_for_workers=False,
                         timeout=timedelta(seconds=max(1.0, timeout_s)))


def form_group(store, name: str, rank: int, size: int, device: torch.device | str = "cpu",
               timeout_s: float = 600.0, should_abort: Callable[[], bool] | None = None) -> WeightGroup:
    """Join group ``name`` as ``rank`` of ``size``; every rank calls this with
    the same ``name`` (a new name for every re-formation: the store keeps
    the old one's keys)."""
    device = torch.device(device)
    prefixed = dist.PrefixStore(f"weights/{name}", store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    return WeightGroup(group, rank, size, device, should_abort)
