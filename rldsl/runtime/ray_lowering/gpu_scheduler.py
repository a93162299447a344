"""The cluster's GPU lease scheduler as one Ray actor, and each pipeline's
client of it.

The policy lives in the control plane (control/leases.py); this module only
hosts it: an async actor, so a waiting ``acquire`` or ``revoked`` long poll
costs no thread, and every call runs on its one event loop. A controller
reaches it through ``RayLeases``; when the actor is gone every call raises
``SchedulerLost`` and the pipelines stop with that named error.
"""

from __future__ import annotations

from typing import Sequence

from rldsl.runtime.control.errors import SchedulerLost
from rldsl.runtime.control.leases import LeaseScheduler, LeaseWithdrawn

SCHEDULER_NAME = "gpu-scheduler"


class GpuSchedulerActor:
    def __init__(self, gpus: Sequence[str], quantum_s: float) -> None:
        self.book = LeaseScheduler(gpus, quantum_s=quantum_s)

    async def ready(self) -> bool:
        return True

    async def register(self, pipeline: str, weight: float, priority: int) -> None:
        self.book.register(pipeline, weight, priority)

    async def acquire(self, pipeline: str, holder: str, gpus: list[str], kind: str) -> None:
        await self.book.acquire(pipeline, holder, gpus, kind)

    async def release(self, pipeline: str, holder: str) -> None:
        self.book.release(pipeline, holder)

    async def set_idle(self, pipeline: str, holder: str, idle: bool) -> None:
        self.book.set_idle(pipeline, holder, idle)

    async def revoked(self, pipeline: str, seen: int) -> tuple[int, list[str]]:
        return await self.book.revoked(pipeline, seen)

    async def finish(self, pipeline: str) -> None:
        self.book.finish(pipeline)

    async def stats(self, pipeline: str) -> dict:
        return self.book.stats(pipeline)


def start_scheduler(gpus: Sequence[str], quantum_s: float, shares: dict[str, tuple[float, int]]):
    """The scheduler actor, every sharing pipeline registered (name -> (weight, priority))."""
    import ray

    from rldsl.runtime.ray_lowering.cluster import ACTOR_NUM_CPUS

    actor = ray.remote(GpuSchedulerActor).options(name=SCHEDULER_NAME, num_cpus=ACTOR_NUM_CPUS,
                                                  max_concurrency=1000).remote(list(gpus), quantum_s)
    ray.get([actor.register.remote(name, weight, priority) for name, (weight, priority) in shares.items()])
    return actor


class RayLeases:
    """A controller's ``LeaseClient`` over the scheduler actor."""

    def __init__(self, actor, pipeline: str) -> None:
        self.actor, self.pipeline = actor, pipeline

    async def acquire(self, holder: str, gpus: Sequence[str], kind: str) -> None:
        await self._call("acquire", holder, list(gpus), kind)

    async def release(self, holder: str) -> None:
        await self._call("release", holder)

    async def set_idle(self, holder: str, idle: bool) -> None:
        await self._call("set_idle", holder, idle)

    async def revoked(self, seen: int) -> tuple[int, list[str]]:
        return tuple(await self._call("revoked", seen))

    async def finish(self) -> None:
        await self._call("finish")

    async def _call(self, method: str, *args):
        import ray

        try:
            return await getattr(self.actor, method).remote(self.pipeline, *args)
        except ray.exceptions.RayActorError as err:
            raise SchedulerLost(f"the GPU lease scheduler actor `{SCHEDULER_NAME}` died ({_first_line(err)}): "
                                f"pipeline `{self.pipeline}` cannot know whose turn a shared GPU is, so it stops; "
                                "resume the run with `rldsl run --resume RUN_DIR`") from None
        except ray.exceptions.RayTaskError as err:
            cause = err.as_instanceof_cause()
            if isinstance(cause, LeaseWithdrawn):
                raise LeaseWithdrawn(str(cause)) from None
            raise


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
