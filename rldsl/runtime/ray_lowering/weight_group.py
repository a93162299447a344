"""The collective weight transport on Ray: which edges use it, the members'
side, and the controller's side.

A sync edge goes rank to rank (``rldsl.runtime.transport``) when every
receiver can stand in a collective whenever a version is ready: a torch
(or sim) engine that never sleeps, fed by a torch, fsdp, megatron or sim
trainer. ``transport = auto`` picks that where the tensors live on GPUs
(NCCL); on logical GPUs it keeps the object store, where a push costs a
host copy either way. ``transport = collective`` asks for it anywhere
(gloo on a CPU); ``object_store`` never.

The group (trainer rank 0 as rank 0, then every receiver worker; a vLLM
replica's workers are a rank each) forms at the first export, through the
run's rendezvous. An export then *is* the push: the trainer streams each bucket while the receivers apply it in
place between two decode batches, so every generator changes version at
the same boundary and none holds more than a couple of buckets beyond its
own weights. Nothing of the model stays in host memory, except what the
evaluator needs (it is a CPU process; ``eval_size = 0`` turns it off).

When a push fails (a receiver died, the group broke), that version goes
through the object store instead and the group is formed anew, without the
lost, at the next export. A receiver that dies between pushes is replaced
only if the object store holds the current version; otherwise its replica
is reported lost, as there is no host copy to bring a replacement up to
date (``transport = object_store`` keeps one).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import tempfile
import uuid
from dataclasses import dataclass, field

from rldsl.plan import PipelinePlan
from rldsl.runtime.control.errors import WorkerLost

log = logging.getLogger(__name__)

COLLECTIVE, OBJECT_STORE = "collective", "object_store"
IF_CUDA = "collective_if_cuda"  # `auto` where a collective works: decided by whether the trainer sees CUDA


def receivers_sleep(settings) -> bool:
    """Whether a generator replica ever sleeps (RunSettings): colocated with
    the trainer, partial overlap, or GPUs leased from other pipelines."""
    return bool(settings.sleeping_replicas) or settings.leased or settings.takes_turns


def choose_transport(pipe: PipelinePlan, receivers_sleep: bool) -> tuple[str, str]:
    """``(transport, why)`` for the pipeline's sync edges; ``auto`` that a
    collective could serve stays open (IF_CUDA) until the trainer says
    whether its tensors are on a GPU."""
    sync = next((s for s in pipe.stages if s.kind == "sync"), None)
    asked = sync.settings.get("transport", "auto") if sync else OBJECT_STORE
    if sync is None or asked == OBJECT_STORE:
        return OBJECT_STORE, "asked for" if sync else "no sync"
    blocker = pipe.collective_blocker(receivers_sleep)
    if blocker is not None:
        if asked == COLLECTIVE:
            raise ValueError(f"stage `{sync.name}`: `transport = collective` cannot be used: {blocker}; "
                             "use `transport = auto` or `object_store`")
        return OBJECT_STORE, blocker
    if asked == "auto":
        if any(pipe.stage(name).engine.name == "sim" for name in pipe.weight_receivers()):
            return OBJECT_STORE, "sim receivers hold no weights"
        return IF_CUDA, "rank to rank where the trainer sees CUDA"
    return COLLECTIVE, "asked for"


def settle(transport: dict, trainer_sees_cuda: bool) -> dict:
    """An open ``auto`` decided: rank to rank over NCCL on real GPUs, the
    object store on logical ones (a push is a host copy either way)."""
    if transport["transport"] != IF_CUDA:
        backend = "NCCL" if trainer_sees_cuda else "gloo"
        return {**transport, "why": f"{transport['why']}, rank to rank over {backend}"} \
            if transport["transport"] == COLLECTIVE else transport
    if trainer_sees_cuda:
        return {**transport, "transport": COLLECTIVE, "why": "auto: rank to rank over NCCL"}
    return {**transport, "transport": OBJECT_STORE, "why": "auto: logical GPUs, a push is a host copy either way"}


class WeightGroupMember:
    """What a worker needs to stand in a weight group (mixed into the trainer
    and receiver workers)."""

    _weight_group = None

    def weight_group_ranks(self) -> int:
        """How many ranks of the group this member stands for: one, or, where
        the engine's own workers stand in the group (a vLLM replica's), one
        per worker."""
        engine = self._group_engine()
        return engine.weight_group_ranks if engine is not None else 1

    def _group_engine(self):
        """The engine whose workers join weight groups themselves, else None."""
        engine = getattr(self, "engine", None)
        return engine if getattr(engine, "joins_weight_groups", False) else None

    def sees_cuda(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def join_weight_group(self, name: str, rank: int, size: int, store_dir: str | None) -> None:
        """Form group ``name`` (every member calls this at once)."""
        import torch

        from rldsl.runtime.ray_lowering.rendezvous import collective_timeout_s, group_store
        from rldsl.runtime.transport.group import form_group

        if self._weight_group is not None:  # the previous epoch's group goes first, without waiting on it
            self._weight_group.close()
            self._weight_group = None
        if self._group_engine() is not None:
            self._weight_group = EngineInGroup.join(self._group_engine(), name, rank, size, store_dir)
            return
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        store = group_store(name, rank, size, store_dir)
        self._weight_group = form_group(store, name, rank, size, device, collective_timeout_s(),
                                        should_abort=_called_off(name))

    def _leave_weight_group(self) -> None:
        """A transfer through the group failed: let go of it now. On NCCL
        ``abort()`` ends the work still pending in it at once, instead of
        its watchdog tearing the process down at the collective timeout;
        the next export forms a new group."""
        group, self._weight_group = self._weight_group, None
        if group is not None:
            group.close()

    def _member_group(self):
        if self._weight_group is None:
            raise RuntimeError("this worker is not in the current weight group (a replacement joins at the next "
                               "export)")
        return self._weight_group

    def _receive_into(self, engine, version: int) -> dict:
        """Apply every streamed bucket of ``version`` to ``engine``, in place."""
        from rldsl.runtime.transport.stream import StreamStats, receive_buckets

        stats = StreamStats()
        for bucket, last in receive_buckets(self._member_group(), version, stats):
            engine.update_weights(bucket, version, last)
        return stats.as_dict()


@dataclass
class EngineInGroup:
    """A member whose engine's workers are the group's ranks (a vLLM
    replica's, engines/vllm_receiver.py). They are vLLM's processes,
    outside Ray: this actor finds the group's store on the board for them,
    and creates a file they watch when the board calls a push off (a worker
    on another node than its actor cannot see it, and hears of a failed
    push from the sender's abort or the group's timeout)."""

    name: str
    called_off_file: str

    @classmethod
    def join(cls, engine, name: str, rank: int, size: int, store_dir: str | None) -> "EngineInGroup":
        from rldsl.runtime.ray_lowering.rendezvous import collective_timeout_s, store_address

        called_off_file = os.path.join(tempfile.gettempdir(), f"rldsl-push-called-off-{uuid.uuid4().hex}")
        store = store_address(name, range(rank, rank + engine.weight_group_ranks), size, store_dir)
        engine.join_weight_group({"group": name, "rank_offset": rank, "size": size, "store": store,
                                  "timeout_s": collective_timeout_s(), "called_off_file": called_off_file})
        return cls(name, called_off_file)

    def receive(self, engine, version: int) -> dict:
        return engine.receive_stream(version, _called_off(self.name), self.called_off_file)

    def close(self) -> None:
        """The workers leave the group themselves (a failed push, the next join)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.called_off_file)


def _called_off(group: str):
    """Asks the run's board whether a transfer of ``group`` was called off."""
    import ray

    from rldsl.runtime.ray_lowering.rendezvous import BOARD_NAME

    board = ray.get_actor(BOARD_NAME)
    return lambda: ray.get(board.called_off.remote(group))


@dataclass
class CollectiveSync:
    """The controller's side of one pipeline's weight group.

    ``members``: (stage, rank) of every receiver worker; the trainer's rank
    0 is the group's rank 0. ``lost``: receivers dropped for good."""

    name: str
    members: list[tuple[str, int]]
    store_dir: str | None
    enabled: bool = True  # False once an open `auto` settled on the object store
    epoch: int = 0
    formed: bool = False
    delivered: int | None = None  # the version the last collective push completed
    failures: int = 0
    last_stats: dict = field(default_factory=dict)
    lost: set[tuple[str, int]] = field(default_factory=set)
    joined: str | None = None  # the name the members last joined under (what a call-off must name)

    @property
    def group(self) -> str:
        return f"{self.name}#{self.epoch}"

    def current_members(self) -> list[tuple[str, int]]:
        return [m for m in self.members if m not in self.lost]

    async def push(self, call, trainer_ranks: range, train_stage: str, bucket_bytes: int, version: int,
                   to_store: bool) -> list:
        """Stream ``version`` to every member; returns the object references
        the trainer also stored (``to_store``), else []. Raises on failure
        (a trainer's loss as it came), and the group re-forms at the next push."""
        try:
            if not self.formed:
                await self._form(call, train_stage)
            members = self.current_members()
            calls = [call(train_stage, r, "stream_weights", bucket_bytes, version, to_store) for r in trainer_ranks]
            calls += [call(*member, "receive_stream", version) for member in members]
            # the name they joined, not self.group: a member replaced since (mid-join) moved the epoch on
            results = await _all_or_call_off(calls, self.joined)
        except BaseException:
            self._broken()
            raise
        trainer_results, receiver_results = results[:len(trainer_ranks)], results[len(trainer_ranks):]
        failure = next((r for r in trainer_results if isinstance(r, BaseException)), None)
        if failure is None:
            failure = next((r for r in receiver_results if isinstance(r, BaseException)), None)
        for member, result in zip(members, receiver_results):
            if isinstance(result, WorkerLost):
                self.lost.add(member)
        sent = trainer_results[0] if failure is None else {}
        if failure is not None or sent.get("failed"):
            self._broken()
            raise failure or RuntimeError(sent["failed"])
        self.delivered, self.last_stats = version, sent.get("stats", {})
        return sent.get("refs", [])

    def replaced(self, member: tuple[str, int]) -> None:
        """A member's actor was replaced: the group re-forms with the new one."""
        self._broken(failed=False)

    def lose(self, member: tuple[str, int]) -> None:
        self.lost.add(member)
        self._broken()

    async def _form(self, call, train_stage: str) -> None:
        """Every live member joins this epoch's group. Members are asked
        first whether they live (a dead one is replaced, or dropped for good
        when it cannot be): a join that waits for a dead rank would hold
        every other member until the rendezvous timeout."""
        alive = await asyncio.gather(*(call(*m, "ready") for m in self.current_members()), return_exceptions=True)
        for member, result in zip(self.current_members(), alive):
            if isinstance(result, WorkerLost):
                self.lost.add(member)
        members = self.current_members()
        counts = await asyncio.gather(*(call(*m, "weight_group_ranks") for m in members))
        firsts = list(itertools.accumulate(counts, initial=1))  # each member's first rank; the trainer's rank 0
        name, size, epoch = self.group, firsts[-1], self.epoch
        self.joined = name
        await asyncio.gather(call(train_stage, 0, "join_weight_group", name, 0, size, self.store_dir),
                             *(call(*m, "join_weight_group", name, first, size, self.store_dir)
                               for m, first in zip(members, firsts)))
        if self.epoch != epoch:  # a member died mid-join: its replacement joined beside what the others met
            raise RuntimeError(f"a member of weight group {name} was replaced while the group formed")
        self.formed = True

    def _broken(self, failed: bool = True) -> None:
        self.failures += failed
        self.formed, self.delivered = False, None
        self.epoch += 1


async def _all_or_call_off(calls: list, group: str) -> list:
    """Every call's result or exception, in order. The first to fail, or a
    trainer reporting a failed send, calls the transfer off on the board,
    so the members still waiting on the broken group return at once."""
    import ray

    from rldsl.runtime.ray_lowering.rendezvous import BOARD_NAME

    tasks = [asyncio.ensure_future(c) for c in calls]
    pending, called_off = set(tasks), False
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        failed = any(t.exception() is not None or (isinstance(t.result(), dict) and t.result().get("failed"))
                     for t in done)
        if failed and not called_off and pending:
            called_off = True
            log.warning("a weight push of group %s failed; calling it off for the other members", group)
            await ray.get_actor(BOARD_NAME).call_off.remote(group)
    return [t.exception() if t.exception() is not None else t.result() for t in tasks]
