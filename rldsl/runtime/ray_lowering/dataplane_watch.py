"""The data plane supervised like any actor: losing it is named at once.

Every sample between stages lives in the data plane's actors (TransferQueue's
controller and storage units). When one dies its samples are gone and every
put and get waits or fails, which would otherwise surface only as the
watchdog's stall long after, blamed on whichever stage waited. The
controller actor runs its pumps under ``run_watched``: a ping to each
data-plane actor every ``WATCH_PERIOD_S``; an actor that answers with its
death (Ray knows within moments of a kill, a crash or its node's loss) ends
the run with ``DataPlaneLost`` naming it. A ping that is merely slow (the
actor busy) is not a death: it is awaited on the next round.

The run then stops like any failed run: the open groups stay open in the
journal (they cannot be scored or trained without their data), summary.json
says which actor died, and the run resumes from its last checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, TypeVar

from rldsl.runtime.control.errors import StepFailed

WATCH_PERIOD_S = 1.0  # a death is named within about this, plus Ray's own notice
_CANCEL_WAIT_S = 30.0  # for the pumps to wind down once the data plane is gone

T = TypeVar("T")


class DataPlaneLost(StepFailed):
    """An actor of the data plane died: the samples stored in it are lost."""


async def run_watched(main: Awaitable[T], actors: dict[str, object], period_s: float = WATCH_PERIOD_S) -> T:
    """``main``'s result, unless one of ``actors`` dies first: then ``main``
    is cancelled (the controller journals how it ended) and ``DataPlaneLost``
    is raised."""
    if not actors:
        return await main
    run = asyncio.ensure_future(main)
    watch = asyncio.ensure_future(watch_dataplane(actors, period_s))
    try:
        await asyncio.wait({run, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        run.cancel()
        raise
    finally:
        if not watch.done():
            watch.cancel()
    if run.done():
        return run.result()
    loss = watch.exception()
    run.cancel(str(loss))
    with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError, Exception):
        await asyncio.wait_for(run, _CANCEL_WAIT_S)
    raise loss


async def watch_dataplane(actors: dict[str, object], period_s: float = WATCH_PERIOD_S) -> None:
    """Ping every actor each period; raise ``DataPlaneLost`` for the first
    one found dead. Returns never otherwise."""
    import ray

    pending: dict[str, object] = {}
    while True:
        for name, actor in actors.items():
            if name not in pending:
                pending[name] = actor.__ray_ready__.remote()
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=0)
        for name, ref in list(pending.items()):
            if ref in ready:
                del pending[name]
                _raise_if_dead(name, ref)
        await asyncio.sleep(period_s)


def _raise_if_dead(name: str, ref) -> None:
    import ray

    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError as error:
        raise DataPlaneLost(f"the data plane's {name} died ({describe_death(error)}); the samples it held are "
                            "lost") from None
    except ray.exceptions.RayError:  # an answer that failed otherwise: the actor is still there
        pass


def describe_death(error: BaseException) -> str:
    """Ray's reason in one line: its type and the first sentence of its message."""
    text = " ".join(str(error).split())
    for marker in ("The actor died", "The actor is dead", "The actor"):
        start = text.find(marker)
        if start >= 0:
            text = text[start:]
            break
    sentence = text.split(". ")[0].rstrip(".")
    return f"{type(error).__name__}: {sentence[:200]}"


def say_if_dataplane_lost(error: BaseException, say) -> None:
    """Name a lost data plane as soon as the driver learns of it: the run's
    teardown (traces, Ray) takes seconds more before its error line."""
    cause = getattr(error, "cause", None) or error
    if isinstance(cause, DataPlaneLost):
        say(f"stopping: {cause}")
