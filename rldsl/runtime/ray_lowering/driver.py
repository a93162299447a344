"""The driver process of `rldsl run`: one Ray session, one data plane and one
set of placement groups for every pipeline of the plan, each pipeline driven
by its own controller (pipeline_driver.py), all followed together."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from rldsl.plan import ExecutionPlan
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.ray_lowering.pipeline_driver import (
    ACTOR_CPUS,
    PipelineDriver,
    ResumeError,
    StageStartError,
    root_cause,
)

__all__ = ["Driver", "ResumeError", "StageStartError"]

_READY_TIMEOUT_S = 600.0
_POLL_S = 0.5


class Driver:
    """``settings``: pipeline name -> RunSettings. With several pipelines each
    writes its own run directory below ``run_dir`` (``run_dir/<pipeline>``)
    and its output lines start with its name."""

    def __init__(self, plan: ExecutionPlan, settings: dict[str, RunSettings], run_dir: Path,
                 address: str | None = None, resume: bool = False, started: float | None = None):
        self.plan, self.address = plan, address
        self.run_dir = run_dir.resolve()
        many = len(plan.pipelines) > 1
        started = started if started is not None else time.monotonic()
        self.pipelines = [PipelineDriver(pipe, settings[pipe.name], self.run_dir / pipe.name if many else self.run_dir,
                                         resume, started, prefix=f"{pipe.name}/" if many else "")
                          for pipe in plan.pipelines]

    def run(self) -> int:
        from rldsl.runtime.ray_lowering.cluster import logical_cpus_needed, ray_session

        actors = sum(p.actor_count() for p in self.pipelines)
        cluster = self.plan.cluster
        gpus = cluster.nodes * cluster.gpus_per_node
        _say(f"starting Ray: {actors} actors, {gpus} GPUs ({'logical' if self.address is None else 'cluster'})")
        name = "+".join(p.name for p in self.plan.pipelines)
        with ray_session(self.address, logical_cpus_needed(actors * ACTOR_CPUS), gpus,
                         namespace=f"rldsl-{name}") as session:
            for pipeline in self.pipelines:
                pipeline.prepare_models()
            dataplane = _dataplane(session)
            groups = self._placement_groups()
            for pipeline in self.pipelines:
                pipeline.create_actors(dataplane.spec, groups)
            _wait_ready({call: stage for p in self.pipelines for call, stage in p.ready_calls().items()})
            for pipeline in self.pipelines:
                pipeline.restore()
                pipeline.offload_for_generation()
            return self._drive(dataplane.spec)

    def _placement_groups(self) -> dict[tuple[int, int], tuple]:
        """One STRICT_PACK group per node holding every GPU the plan uses there
        (pipelines that share a GPU share its bundle)."""
        from rldsl.runtime.ray_lowering.placement import create_placement_group

        used: dict[int, set[int]] = {}
        for node, gpu in self.plan.gpu_users():
            used.setdefault(node, set()).add(gpu)
        out = {}
        for node, gpus in sorted(used.items()):
            ordered = sorted(gpus)
            pg = create_placement_group([{"GPU": 1.0} for _ in ordered], "STRICT_PACK",
                                        name=f"{self.plan.pipelines[0].name}-node{node}", timeout_s=60.0)
            out.update({(node, gpu): (pg, i) for i, gpu in enumerate(ordered)})
        return out

    def _drive(self, dataplane_spec: dict) -> int:
        """Follow every pipeline until all are done; Ctrl-C stops them all at a
        safe point and checkpoints each. A failed pipeline does not stop the
        others; the first failure is raised once all have ended."""
        import ray

        live = len(self.pipelines) == 1  # a live view per pipeline cannot share one terminal
        running = [p for p in self.pipelines if p.begin(dataplane_spec, live=live)]
        try:
            with contextlib.ExitStack() as stack:
                for pipeline in running:
                    stack.enter_context(pipeline.progress)
                active = list(running)
                while active:
                    ray.wait([p.result_ref for p in active], num_returns=1, timeout=_POLL_S)
                    active = [p for p in active if not p.poll()]
        except KeyboardInterrupt:
            return self._stop(running)
        failures = []
        for pipeline in running:
            try:
                pipeline.complete()
            except ray.exceptions.RayError as err:  # the controller's PipelineStalled / StepFailed, as Ray wraps it
                failures.append(err)
        if failures:
            raise failures[0]
        return 0

    def _stop(self, running: list[PipelineDriver]) -> int:
        _say("interrupted: stopping after the trainer call in flight (Ctrl-C again quits at once)")
        for pipeline in running:
            pipeline.request_stop()
        for pipeline in running:
            pipeline.checkpoint_on_interrupt(f"rldsl run --resume {self.run_dir}")
        return 130


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _dataplane(session):
    from rldsl.runtime.dataplane import connect_dataplane

    plane = connect_dataplane({"backend": "transferqueue", "storage_units": 1})
    session.add_cleanup(plane.close)
    return plane


def _wait_ready(pending: dict) -> None:
    """``pending``: ready calls -> stage names; the first start-up error is raised, named."""
    import ray

    deadline = time.monotonic() + _READY_TIMEOUT_S
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise TimeoutError(f"stage actors not ready after {_READY_TIMEOUT_S:.0f}s: "
                               + ", ".join(sorted(set(pending.values()))))
        try:
            ray.get(done[0])
        except ray.exceptions.RayError as err:  # the actor's own start-up error, named, without Ray's wrapping
            raise StageStartError(f"stage `{pending[done[0]]}` failed to start: {root_cause(err)}") from None
        pending.pop(done[0])
