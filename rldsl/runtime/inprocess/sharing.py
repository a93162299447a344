"""Several sim pipelines sharing GPUs in one process: a controller each, one
lease scheduler and one ``GpuBoard`` for all, on one event loop. Tests and
benchmarks drive the same control-plane code a Ray run does."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from rldsl.runtime.control.controller import Controller
from rldsl.runtime.control.leases import LeaseScheduler, LocalLeases
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.dataplane import InMemoryDataPlane
from rldsl.runtime.inprocess.sim_stages import GpuBoard, SimConfig, SimStages
from rldsl.runtime.protocols import Prompt


@dataclass(frozen=True)
class SharingPipeline:
    settings: RunSettings
    config: SimConfig
    weight: float = 1.0
    priority: int = 0


def _prompts():
    return (Prompt(i, f"question {i}", "answer") for i in itertools.count())


async def run_sharing(pipelines: list[SharingPipeline], quantum_s: float = 0.5,
                      scheduler: LeaseScheduler | None = None) -> tuple[dict[str, dict], GpuBoard]:
    """Run every pipeline to its end on ``scheduler`` (by default one over
    every GPU they lease); each summary carries its lease figures under
    ``gpu_sharing``. The first failure is raised once all ended."""
    if scheduler is None:
        gpus = {gpu for p in pipelines for gpu in p.settings.trainer_lease} | \
            {gpu for p in pipelines for leased in p.settings.replica_leases for gpu in leased}
        scheduler = LeaseScheduler(gpus, quantum_s=quantum_s)
    board = GpuBoard()
    controllers = []
    for pipe in pipelines:
        scheduler.register(pipe.settings.pipeline, pipe.weight, pipe.priority)
        dataplane = InMemoryDataPlane()
        stages = SimStages(pipe.settings, dataplane, pipe.config, board)
        leases = LocalLeases(scheduler, pipe.settings.pipeline) if pipe.settings.leased else None
        controllers.append(Controller(pipe.settings, stages.handles, dataplane, _prompts(), leases=leases))
    results = await asyncio.gather(*(c.run() for c in controllers), return_exceptions=True)
    summaries = {}
    for controller, result in zip(controllers, results):
        if isinstance(result, BaseException):
            raise result
        result["gpu_sharing"] = scheduler.stats(controller.settings.pipeline)
        summaries[controller.settings.pipeline] = result
    return summaries, board
