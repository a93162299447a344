"""Calls into stage actors that survive the actor's death.

Generator, reward and logprob actors hold nothing that cannot be rebuilt:
their engine comes from the plan and their weights from the host bucket
cache. When a call finds its actor dead, the supervisor starts a new actor
from the same spec (class, arguments, placement bundle), waits until it is
ready, lets the lowering bring it to the current weights, and makes the
call again once. Concurrent callers of the same dead actor share one
replacement. A trainer rank is not replaced: its optimizer state died with
it, so its death ends the step (the control plane names it).

A call that still fails, or an actor that cannot be replaced, raises
``WorkerLost``: the control plane drops the affected samples as
``worker_died`` and the run goes on.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from rldsl.runtime.control.errors import WorkerLost
from rldsl.runtime.ray_lowering.actor_process import METHOD_GROUPS

REPLACE_TIMEOUT_S = 300.0  # a new actor imports torch and builds its engine; on a loaded node that takes a while


@dataclass
class ActorSpec:
    """How one stage rank's actor was made, to make it again."""

    stage: str
    kind: str  # generate | reward | logprob | train
    rank: int
    actor_class: type  # the worker class (workers.py), made remote when started
    args: tuple
    options: dict
    replaceable: bool = True
    replacements: int = 0
    tenant: str | None = None  # another pipeline's generator serving this one: calls go through its `serve`


@dataclass
class Recovery:
    """One replaced actor: what died, how long the replacement took."""

    stage: str
    rank: int
    cause: str
    seconds: float
    at: float = field(default_factory=time.time)


def _is_actor_death(error: BaseException) -> bool:
    import ray

    return isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


class Supervisor:
    """The current actor of every stage rank, replaced when it dies.

    ``on_replaced(spec, actor)`` runs after a replacement is ready and before
    any call reaches it (weights from the host cache); ``recoveries`` lists
    every replacement, ``losses`` every rank that died and could not be
    replaced, for the run's messages and summary."""

    def __init__(self, specs: dict[str, list[ActorSpec]], actors: dict[str, list]) -> None:
        self.specs = specs
        self.actors = {name: list(handles) for name, handles in actors.items()}
        self.on_replaced: Callable[[ActorSpec, Any], Awaitable[None]] | None = None
        self.recoveries: list[Recovery] = []
        self.losses: list[dict] = []  # {"stage", "rank", "cause"}: a rank gone for good, said once
        self.replaced_handles: dict[str, Any] = {}  # actor name -> its newest handle, for the driver
        self._replacing: dict[tuple[str, int], asyncio.Task] = {}

    def actor(self, stage: str, rank: int):
        return self.actors[stage][rank]

    def remote(self, stage: str, rank: int, method: str, *args: Any, actor: Any = None):
        """``actor.method.remote(*args)`` on the rank's current actor (or ``actor``), through its ``serve``
        when another pipeline's generator serves the stage."""
        actor = actor if actor is not None else self.actor(stage, rank)
        return remote_call(actor, method, *args, tenant=self.specs[stage][rank].tenant if stage in self.specs else None)

    async def call(self, stage: str, rank: int, method: str, *args: Any) -> Any:
        """``actor.method.remote(*args)`` on the rank's current actor; once
        more on a replacement if it died."""
        actor = self.actor(stage, rank)
        try:
            return await self.remote(stage, rank, method, *args, actor=actor)
        except Exception as error:
            if not _is_actor_death(error):
                raise
            replacement = await self.replace(stage, rank, actor, error)
        try:
            return await self.remote(stage, rank, method, *args, actor=replacement)
        except Exception as error:
            if _is_actor_death(error):
                raise self._lost(stage, rank, f"its replacement died too: {_short(error)}") from None
            raise

    async def replace(self, stage: str, rank: int, dead: Any, cause: BaseException) -> Any:
        """The rank's new actor; one replacement however many callers saw the death."""
        if self.actor(stage, rank) is not dead:
            return self.actor(stage, rank)  # another caller already replaced it
        spec = self.specs[stage][rank]
        if not spec.replaceable:
            raise self._lost(stage, rank, _short(cause))
        key = (stage, rank)
        if key not in self._replacing:
            self._replacing[key] = asyncio.ensure_future(self._start_replacement(spec, cause))
        try:
            return await asyncio.shield(self._replacing[key])
        finally:
            if self._replacing.get(key) is not None and self._replacing[key].done():
                self._replacing.pop(key, None)

    async def _start_replacement(self, spec: ActorSpec, cause: BaseException) -> Any:
        started = time.monotonic()
        spec.replacements += 1
        options = dict(spec.options)
        name = f"{options.get('name', spec.stage)}~{spec.replacements}"
        options["name"] = name  # the dead actor's name may not be free yet
        try:
            from rldsl.runtime.ray_lowering.actor_process import run_actor

            actor = run_actor(spec.actor_class).options(**options).remote(*spec.args)
            await asyncio.wait_for(_ready(actor), REPLACE_TIMEOUT_S)
            if self.on_replaced is not None:
                await self.on_replaced(spec, actor)
        except Exception as error:  # noqa: BLE001 - any failure to rebuild is the same loss
            raise self._lost(spec.stage, spec.rank, f"{_short(cause)}; no replacement: {_short(error)}") from None
        self.actors[spec.stage][spec.rank] = actor
        self.replaced_handles[spec.options.get("name", name)] = actor
        self.recoveries.append(Recovery(spec.stage, spec.rank, _short(cause), time.monotonic() - started))
        return actor


    def _lost(self, stage: str, rank: int, detail: str) -> WorkerLost:
        """The loss of a rank, recorded once per rank, as the error its callers get."""
        if not any(loss["stage"] == stage and loss["rank"] == rank for loss in self.losses):
            self.losses.append({"stage": stage, "rank": rank, "cause": detail})
        return WorkerLost(stage, rank, detail)


def remote_call(actor, method: str, *args: Any, tenant: str | None = None):
    """``actor.method.remote(*args)``; on a generator serving other pipelines, pipeline ``tenant``'s side of it
    (its ``serve``)."""
    if tenant:
        return actor.serve.remote(tenant, method, *args)
    bound = getattr(actor, method)
    if method in METHOD_GROUPS:
        bound = bound.options(concurrency_group=METHOD_GROUPS[method])
    return bound.remote(*args)


async def _ready(actor) -> None:
    await actor.ready.remote()


def _short(error: BaseException) -> str:
    """The first line of an error: Ray's death messages run to a page."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def root_cause(err: BaseException) -> str:
    """The innermost error's type and message, not Ray's remote traceback."""
    cause = getattr(err, "cause", None) or err.__cause__
    while cause is not None and (getattr(cause, "cause", None) or cause.__cause__) is not None:
        cause = getattr(cause, "cause", None) or cause.__cause__
    cause = cause or err
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"


def exit_detail(error) -> str:
    """Ray's one-line account of how an actor's process ended, without its list of guesses."""
    text = " ".join(str(error).split())
    start = text.find("Worker exit detail:")
    detail = text[start + len("Worker exit detail:"):] if start >= 0 else text
    return detail.split(". Some common causes")[0].strip().rstrip(".") or type(error).__name__
