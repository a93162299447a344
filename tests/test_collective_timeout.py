"""A collective that never completes ends with an error naming its group,
after the collective timeout, not the rendezvous deadline's remainder."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest

from tests.ports import rank_context

torch = pytest.importorskip("torch")


def _rank(rank: int, store: str, answers, answered) -> None:
    import torch.distributed as dist

    from rldsl.runtime.ray_lowering.rendezvous import CollectiveTimeout, _set_collective_timeout, collectives_named

    os.environ["RLDSL_COLLECTIVE_TIMEOUT_S"] = "2"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=0.5 if rank == 0 else 30))  # what a late rendezvous leaves
    _set_collective_timeout(dist)
    if rank == 1:  # a rank that hangs: it never joins the collective (until rank 0 has its answer)
        answered.wait(timeout=8)
        return
    started = time.monotonic()
    try:
        with collectives_named("demo/actor", 0, 2):
            dist.all_reduce(torch.ones(1))
        answers.put(("completed", time.monotonic() - started))
    except CollectiveTimeout as error:
        answers.put((str(error), time.monotonic() - started))


def test_a_hung_collective_names_its_group_after_the_collective_timeout(tmp_path):
    context = rank_context()
    answers, answered = context.Queue(), context.Event()
    ranks = [context.Process(target=_rank, args=(rank, str(tmp_path / "store"), answers, answered))
             for rank in range(2)]
    for process in ranks:
        process.start()
    message, seconds = answers.get(timeout=60)
    answered.set()
    for process in ranks:
        process.join(timeout=30)
    assert "process group `demo/actor` timed out on rank 0 of 2 after 2s" in message
    assert 1.5 <= seconds < 7  # the collective's own 2 s, not the 0.5 s left of the rendezvous, nor forever


def test_other_errors_pass_through_unchanged():
    from rldsl.runtime.ray_lowering.rendezvous import collectives_named

    with pytest.raises(RuntimeError, match="shape mismatch"):
        with collectives_named("demo/actor", 0, 2):
            raise RuntimeError("shape mismatch")
