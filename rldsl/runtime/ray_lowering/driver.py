"""The driver process of `rldsl run`: one Ray session, one data plane and one
set of placement groups for every pipeline of the plan, each pipeline driven
by its own controller (pipeline_driver.py), all followed together."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rldsl.plan import ExecutionPlan
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.ray_lowering import stopping
from rldsl.layout import actor_slots, layout_bundles
from rldsl.runtime.ray_lowering.cluster import ACTOR_NUM_CPUS, ClusterError
from rldsl.runtime.ray_lowering.dataplane_watch import say_if_dataplane_lost
from rldsl.runtime.ray_lowering.pipeline_driver import PipelineDriver, ResumeError, StageStartError
from rldsl.runtime.ray_lowering.supervision import root_cause

__all__ = ["Driver", "ResumeError", "StageStartError"]

_READY_TIMEOUT_S = 600.0
_POLL_S = 0.5


class Driver:
    """``settings``: pipeline name -> RunSettings. With several pipelines each
    writes its own run directory below ``run_dir`` (``run_dir/<pipeline>``)
    and its output lines start with its name. ``grace_s``: how long a stop
    (a signal, stopping.py) may take; ``resume_command`` is printed after one."""

    def __init__(self, plan: ExecutionPlan, settings: dict[str, RunSettings], run_dir: Path,
                 address: str | None = None, resume: bool = False, started: float | None = None,
                 grace_s: float = stopping.DEFAULT_GRACE_S, resume_command: str | None = None):
        self.plan, self.address = plan, address
        self.run_dir = run_dir.resolve()
        self.signals = stopping.StopSignals(grace_s)
        self.resume_command = resume_command or stopping.resume_command(self.run_dir, grace_s=grace_s)
        many = len(plan.pipelines) > 1
        started = started if started is not None else time.monotonic()
        self.pipelines = [PipelineDriver(pipe, settings[pipe.name], self.run_dir / pipe.name if many else self.run_dir,
                                         resume, started, prefix=f"{pipe.name}/" if many else "")
                          for pipe in plan.pipelines]
        layout_bundles(actor_slots(plan), ACTOR_NUM_CPUS)  # a LayoutError before Ray starts

    def run(self) -> int:
        from rldsl.runtime.dataplane.transferqueue import import_in_background

        if all(p.done_by_checkpoint() for p in self.pipelines):  # a finished run resumed: no Ray, no actors
            for pipeline in self.pipelines:
                pipeline.say_nothing_left()
            return 0
        import_in_background()
        try:
            with self._session() as session:
                self.signals.install()  # after ray.init, which installs a SIGTERM handler of its own
                try:
                    return self._start_and_drive(session)
                finally:
                    self.signals.shield()  # the cleanups and Ray's shutdown run to the end
        finally:
            self.signals.restore()

    def _start_and_drive(self, session) -> int:
        try:
            for pipeline in self.pipelines:
                pipeline.prepare_models()
            dataplane = _dataplane(session, [p.pipe.name for p in self.pipelines])
            reservation = self._reserve(session)
            self._start_gpu_scheduler(session)
            by_name = {p.pipe.name: p for p in self.pipelines}
            for pipeline in self.pipelines:
                pipeline.tenants = [p for p in self.pipelines if p.server() == pipeline.pipe.name]
            for pipeline in self.pipelines:
                pipeline.create_actors(dataplane.spec, reservation)
                # a restart on the same cluster reuses their names
                session.add_cleanup(functools.partial(self._end_actors, pipeline))
            for pipeline in self.pipelines:  # every actor exists: the controllers may hold another pipeline's
                if pipeline.server():
                    pipeline.borrow(by_name[pipeline.server()])
                pipeline.start_controller(dataplane.spec, reservation)
            _wait_ready({call: stage for p in self.pipelines for call, stage in p.ready_calls().items()})
            self._check_placement(reservation)
            for pipeline in self.pipelines:
                pipeline.restore()
                pipeline.offload_for_generation()
        except KeyboardInterrupt as err:
            return self._stopped_starting(self.signals.interrupted(err))
        return self._drive()

    def _stopped_starting(self, interrupt) -> int:
        """A stop before training began: nothing to checkpoint, summary.json still says how the run ended."""
        _say(f"{interrupt}: stopping before training started")
        with self.signals.shielded():
            for pipeline in self.pipelines:
                pipeline.write_summary(stop=stopping.stop_record(pipeline, interrupt, self.resume_command),
                                       timeout_s=max(1.0, self.signals.time_left(keep_s=5.0) / 2))
        return self.signals.exit_code

    def _end_actors(self, pipeline: PipelineDriver) -> None:
        """After a stop signal, within what is left of its grace period."""
        pipeline.end_actors(timeout_s=min(15.0, self.signals.time_left(keep_s=5.0)))

    def _start_gpu_scheduler(self, session) -> None:
        """Pipelines that share GPUs take turns on them: one lease scheduler
        actor for the cluster, each sharing pipeline registered with it."""
        import ray

        from rldsl.plan import LEASE_QUANTUM_S
        from rldsl.runtime.control.settings import gpu_id
        from rldsl.runtime.ray_lowering.gpu_scheduler import start_scheduler

        shared = self.plan.gpus_shared_across_pipelines()
        if not shared:
            return
        sharing = [p for p in self.pipelines if p.settings.leased]
        scheduler = start_scheduler([gpu_id(*where) for where in shared], LEASE_QUANTUM_S,
                                    {p.pipe.name: (p.pipe.sharing.weight, p.pipe.sharing.priority) for p in sharing})
        session.add_cleanup(functools.partial(ray.kill, scheduler))
        for pipeline in sharing:
            pipeline.scheduler = scheduler
        _say(f"GPU lease scheduler: {len(shared)} GPUs shared by {', '.join(p.pipe.name for p in sharing)}")

    def dry_run(self) -> int:
        """Reserve the placement groups, start a placeholder for every stage
        actor with the options the real one would get, report where each
        landed against the plan, release everything. 0 when it matches."""
        import ray

        from rldsl.runtime.ray_lowering.placement_check import PlacementProbe

        with self._session() as session:
            reservation = self._reserve(session)
            probe = ray.remote(PlacementProbe)
            actors = {p.actor_name(stage.name, rank.index):
                      probe.options(**p.actor_options(stage.name, rank.index, True, reservation)).remote()
                      for p in self.pipelines for stage in p.pipe.stages for rank in stage.own_ranks if rank.gpus}
            _wait_ready({actor.ready.remote(): name for name, actor in actors.items()})
            report = self._placement_report(reservation, actors)
            reservation.release()
        print(report.table(reservation))
        cpu_actors = sum(p.actor_count() for p in self.pipelines) - len(actors)
        print(f"{cpu_actors} CPU actor(s) (reward workers, CPU stages, controllers, evaluators) "
              "go wherever Ray has CPU")
        for note in report.notes:
            print(f"note: {note}")
        if report.errors:
            for error in report.errors:
                print(f"error: {error}", file=sys.stderr)
            return 2
        print("placement matches the plan")
        return 0

    def _session(self):
        from rldsl.runtime.ray_lowering.cluster import logical_cpus_needed, ray_session

        actors = sum(p.actor_count() for p in self.pipelines)
        cluster = self.plan.cluster
        gpus = cluster.nodes * cluster.gpus_per_node
        _say(f"starting Ray: {actors} actors, {gpus} GPUs ({'logical' if self.address is None else 'cluster'})")
        name = "+".join(p.name for p in self.plan.pipelines)
        return ray_session(self.address, logical_cpus_needed(actors * ACTOR_NUM_CPUS), gpus, namespace=f"rldsl-{name}")

    def _reserve(self, session):
        """The plan's placement groups, each pinned to its Ray node (a local
        Ray holds every plan node), and the board process groups meet on."""
        import ray

        from rldsl.runtime.ray_lowering.placement import reserve
        from rldsl.runtime.ray_lowering.rendezvous import create_board

        fold = session.local  # a local Ray: every plan node on it, each with all its GPUs
        gpus_per_node = self.plan.cluster.gpus_per_node
        layout = layout_bundles(actor_slots(self.plan), ACTOR_NUM_CPUS, gpus_per_node if fold else None)
        reservation = reserve(layout, gpus_per_node, fold=fold, name=self.plan.pipelines[0].name)
        session.add_cleanup(reservation.release)  # a Ray that outlives the run (a cluster's, a test session's)
        self.board = create_board()  # held: a named actor lives as long as a handle to it
        session.add_cleanup(functools.partial(ray.kill, self.board))
        if fold:  # process groups meet in files: no store socket on any interface
            reservation.store_dir = tempfile.mkdtemp(prefix="rldsl-rendezvous-")
            session.add_cleanup(functools.partial(shutil.rmtree, reservation.store_dir, ignore_errors=True))
        return reservation

    def _check_placement(self, reservation) -> None:
        """Every GPU actor where the plan put it, or a ClusterError; placement.json either way."""
        actors = {p.actor_name(stage, rank): actor for p in self.pipelines
                  for stage, handles in p.own_handles().items() for rank, actor in enumerate(handles)}
        report = self._placement_report(reservation, actors)
        (self.run_dir / "placement.json").write_text(json.dumps(report.to_json(reservation), indent=2) + "\n")
        for note in report.notes:
            _say(f"note: {note}")
        if report.errors:
            raise ClusterError("the actors did not land where the plan puts them:\n  " + "\n  ".join(report.errors))

    def _placement_report(self, reservation, actors: dict):
        import ray

        from rldsl.runtime.ray_lowering.placement_check import check_placement

        slots = reservation.layout.slots()
        reports = dict(zip([s.name for s in slots], ray.get([actors[s.name].placement.remote() for s in slots])))
        return check_placement(reservation, reports, slots)

    def _drive(self) -> int:
        """Follow every pipeline until all are done; a stop signal stops them
        all at a safe point and checkpoints each (stopping.py). A failed
        pipeline does not stop the others; the first failure is raised once
        all have ended."""
        import ray

        live = len(self.pipelines) == 1  # a live view per pipeline cannot share one terminal
        running: list[PipelineDriver] = []
        try:
            for pipeline in self.pipelines:  # one by one: a signal meanwhile stops those already begun
                if pipeline.begin(live=live):
                    running.append(pipeline)
            with contextlib.ExitStack() as stack:
                for pipeline in running:
                    stack.enter_context(pipeline.progress)
                active = list(running)
                while active:
                    ray.wait([p.result_ref for p in active], num_returns=1, timeout=_POLL_S)
                    active = [p for p in active if not p.poll()]
            failures = []
            for pipeline in running:
                try:
                    pipeline.complete()
                except ray.exceptions.RayError as err:  # the controller's PipelineStalled / StepFailed, as Ray wraps it
                    say_if_dataplane_lost(err, pipeline.say)  # now, not after the teardown's error line
                    pipeline.write_summary(error=err)
                    failures.append(err)
        except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM, SIGHUP (stopping.StopSignals)
            return stopping.stop_pipelines(running, self.signals, self.signals.interrupted(err), self.resume_command)
        except Exception as err:  # an actor or Ray itself lost: each summary.json still says how its pipeline ended
            for pipeline in running:
                if pipeline.summary is None:
                    try:
                        pipeline.write_summary(error=err)
                    except Exception:  # noqa: BLE001 - the first error is the one to report
                        pass
            raise
        finally:
            with self.signals.shielded():
                for pipeline in running:
                    pipeline.progress.close()  # after the final evaluation (complete) or a stop's last steps
                    pipeline.close_trace(timeout_s=min(10.0, self.signals.time_left(keep_s=8.0)))
        if failures:
            raise failures[0]
        return 0


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _dataplane(session, partitions: list[str]):
    """The run's data plane: TransferQueue, started here or (on a Ray that
    outlives the run) attached to; the run's rows leave it with the run."""
    from rldsl.runtime.dataplane import DataPlaneUnavailable, connect_dataplane

    try:
        plane = connect_dataplane({"backend": "transferqueue", "storage_units": 1})
    except DataPlaneUnavailable as error:  # the cluster's state: said as such, not as a bug of ours
        raise ClusterError(str(error)) from None
    session.add_cleanup(plane.close)
    if not plane.owner:
        session.add_cleanup(functools.partial(_clear_partitions, plane, partitions))
    return plane


def _clear_partitions(plane, partitions: list[str]) -> None:
    for partition in partitions:
        plane.clear(plane.list(partition), partition)


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
