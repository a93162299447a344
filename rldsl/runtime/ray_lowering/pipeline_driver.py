"""One pipeline of `rldsl run`, in phases the driver (driver.py) calls for
every pipeline of the plan: its actors up, resumed, driven by its controller
actor, followed, evaluated, and its run directory written."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from rldsl.plan import PipelinePlan
from rldsl.runtime.control.errors import ControllerLost
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.ray_lowering.actor_process import run_actor
from rldsl.runtime.ray_lowering.cluster import ACTOR_NUM_CPUS
from rldsl.runtime.ray_lowering.evaluation import evaluation_summary
from rldsl.runtime.ray_lowering.final_checkpoint import save_final_checkpoint
from rldsl.runtime.ray_lowering.pipeline_actors import PipelineActors
from rldsl.runtime.ray_lowering.pipeline_evaluations import PipelineEvaluations, previous_evals
from rldsl.runtime.ray_lowering.progress import Progress, rewind_metrics
from rldsl.runtime.ray_lowering.supervision import ActorSpec, exit_detail, remote_call, root_cause
from rldsl.runtime.ray_lowering.trace import TraceCollector


class ResumeError(RuntimeError):
    pass


class StageStartError(RuntimeError):
    pass


class PipelineDriver(PipelineActors, PipelineEvaluations):
    def __init__(self, pipe: PipelinePlan, settings: RunSettings, run_dir: Path, resume: bool = False,
                 started: float | None = None, prefix: str = ""):
        self.pipe, self.settings = pipe, settings
        self.prefix = prefix  # "name/" for actor names and messages when several pipelines share the run
        self.started = started if started is not None else time.monotonic()  # the whole run, start-up included
        self.run_dir = run_dir.resolve()  # actors write checkpoints here, whatever their working directory
        self.trainer_engine = pipe.stage(pipe.batch.train_stage).engine.name
        self.resume = _resume_point(self.run_dir) if resume else None
        if self.resume:  # the steps after the checkpoint are trained again: their records go
            rewind_metrics(self.run_dir, self.resume["steps_done"])
        self.previous_evals: list[dict] = previous_evals(self.run_dir) if resume else []
        self.evaluations = None  # EvaluationSchedule once the evaluator runs
        self.checkpoint = {"run_dir": str(self.run_dir), "every": pipe.run.checkpoint_every,
                           "keep": pipe.run.keep_checkpoints}
        self.handles: dict[str, list] = {}
        self.specs: dict[str, list[ActorSpec]] = {}  # how each actor was made, for the controller to remake it
        self.tenants: list[PipelineDriver] = []  # the pipelines `served_by` this one's generator
        self.borrowed: set[str] = set()  # stages another pipeline's actors serve (`served_by`)
        self.controller = self.result_ref = self.progress = self.traces = None
        self.scheduler = None  # the cluster's GPU lease scheduler, when this pipeline shares GPUs
        self._seen = 0
        self.summary: dict | None = None  # what summary.json says, once written
        self._evaluator_given_up = False
        self._recoveries_shown = 0
        self._losses_shown = 0

    def actor_count(self) -> int:
        return sum(len(s.own_ranks) for s in self.pipe.stages) + 1 + self.pipe.has_evaluator  # + controller, evaluator

    def say(self, text: str) -> None:
        """Progress and notes: stderr."""
        print(f"{self.prefix}{text}" if self.prefix else text, file=sys.stderr, flush=True)

    def tell(self, text: str) -> None:
        """A result the user acts on (how to resume): stdout, with the final table."""
        print(f"{self.prefix}{text}" if self.prefix else text, flush=True)

    # ------------------------------------------------------------ start-up

    def prepare_models(self) -> None:
        """Build the warm start (cached) once here rather than in every actor."""
        model = next(m for m in self.pipe.models if m.name == self.pipe.stage(self.pipe.batch.train_stage).model)
        if self.trainer_engine not in ("torch", "fsdp") or not model.source.startswith("builtin:"):
            return  # local models load in the actors; their errors are reported per stage
        from rldsl.runtime.engines.factory import load_policy
        from rldsl.runtime.engines.torch.warmstart import cache_dir

        started, cached = time.monotonic(), _entries(cache_dir())
        self.say(f"loading {model.source}")
        load_policy(model, self.pipe, self.pipe.run.seed, adapters=False)
        built = _entries(cache_dir()) - cached
        how = (f"its warm start built and cached in {cache_dir()}: later runs load it" if built
               else "its warm start from the cache")
        self.say(f"model ready in {time.monotonic() - started:.1f}s ({how})")

    def start_controller(self, spec: dict, reservation) -> None:
        """The evaluator and the controller, once every stage has its actors (borrowed ones too)."""
        self._create_evaluator()
        self._create_controller(spec, self._weight_transport(reservation))

    def restore(self) -> None:
        """Resuming: trainer ranks reload the checkpoint; its weights go to every receiver."""
        import ray

        if not self.resume:
            return
        trainers = self.handles[self.pipe.batch.train_stage]
        try:
            version = ray.get([t.load_checkpoint.remote(str(self.resume["dir"])) for t in trainers])[0]
        except ray.exceptions.RayError as err:  # e.g. a checkpoint of another layout: say so, no remote traceback
            raise ResumeError(f"{self.prefix}could not restore the trainer from {self.resume['dir']}: "
                              f"{root_cause(err)}") from None
        refs = ray.get([t.export_buckets.remote(self.settings.sync_bucket_bytes) for t in trainers])[0]
        ray.get([remote_call(actor, "receive_weights", refs, version, tenant=spec.tenant)
                 for spec, actor in self._receivers()])
        for observer in self._observers():
            ray.get([observer.update_weights.remote(ref, version, i == len(refs) - 1) for i, ref in enumerate(refs)])
        self.say(f"resumed from {self.resume['dir'].name}: version {version}, {self.resume['steps_done']} steps done")

    def offload_for_generation(self) -> None:
        """Colocated, or on GPUs leased from other pipelines: generation comes
        first, so an offloading trainer starts offloaded."""
        import ray

        if self.settings.takes_turns:
            ray.get([t.sleep.remote() for t in self.handles[self.pipe.batch.train_stage]])

    # ---------------------------------------------------------------- drive

    def _remaining_settings(self) -> RunSettings:
        done_before = self.resume["steps_done"] if self.resume else 0
        return replace(self.settings, steps=max(0, self.settings.steps - done_before))

    def _weight_transport(self, reservation) -> dict:
        """How the sync moves weights (weight_group.py); the controller settles an open `auto`."""
        from rldsl.runtime.ray_lowering.weight_group import choose_transport, receivers_sleep

        transport, why = choose_transport(self.pipe, receivers_sleep(self.settings))
        return {"transport": transport, "why": why, "group": f"{self.prefix}weights",
                "store_dir": reservation.store_dir}

    def _create_controller(self, dataplane_spec: dict, transport: dict | None = None) -> None:
        """The controller actor, started with the stage actors so that its
        process comes up (imports, data-plane client) in parallel with theirs."""

        from rldsl.runtime.ray_lowering.controller_actor import ControllerActor

        if self._remaining_settings().steps <= 0:
            return
        self.controller = run_actor(ControllerActor).options(
            num_cpus=ACTOR_NUM_CPUS, name=f"{self.prefix}controller").remote(
            self._remaining_settings(), self.pipe, self.handles, self.specs, dataplane_spec, self.checkpoint,
            self.resume_info(), self._observers(), self.scheduler, transport)

    def done_by_checkpoint(self) -> bool:
        """A resumed run whose checkpoint already holds every step (nothing needs to start for it)."""
        return self._remaining_settings().steps <= 0

    def say_nothing_left(self) -> None:
        done_before = self.resume["steps_done"] if self.resume else 0
        self.say(f"nothing to do: {done_before} of {self.settings.steps} steps are done"
                 + (f" (to train more: `--resume DIR --steps N` with N > {done_before})"
                    if done_before > self.settings.steps else ""))

    def begin(self, live: bool = True) -> bool:
        """Start the controller's loop; False when the resumed run has nothing left to do."""
        if self.controller is None:
            self.say_nothing_left()
            return False
        self._say_transport()
        self.progress = Progress(self.settings, self.run_dir, prefix=self.prefix, live=live, log=self.pipe.run.log,
                                 name=self.pipe.name, config=_logged_config(self.pipe),
                                 first_step=self.resume["steps_done"] + 1 if self.resume else None)
        if self.evaluations and self.evaluations.at_start and not self.resume:
            self.evaluations.request(step=0, version=0)
        if self.evaluations and self.resume:
            self.redo_skipped_evaluations(self.resume["version"])
        self.result_ref = self.controller.run.remote()
        self.traces = TraceCollector(self.run_dir, self._traced_actors(), self.pipe.name)
        return True

    def _say_transport(self) -> None:
        import ray

        transport = ray.get(self.controller.settle_transport.remote())
        if any(s.kind == "sync" for s in self.pipe.stages):
            self.say(f"weights: {transport['transport'].replace('_', ' ')} ({transport['why']})")

    def _traced_actors(self) -> dict:
        actors = {self.actor_name(name, rank): actor for name, handles in self.own_handles().items()
                  for rank, actor in enumerate(handles)}
        actors[f"{self.prefix}controller"] = self.controller
        if self._has_evaluator_actor():
            actors[f"{self.prefix}evaluator"] = self.evaluations.actor
        return actors

    def close_trace(self, timeout_s: float = 10.0) -> None:
        """The last spans of every actor, and trace.json (on every exit path)."""
        if self.traces is not None:
            path = self.traces.close(timeout_s)
            if path is not None:
                self.say(f"trace: {path} (open it in Perfetto or chrome://tracing)")
            elif self.traces.failed:
                self.say(f"trace: not written: {self.traces.failed}")

    def poll(self) -> bool:
        """Show what happened since the last poll; True once the controller is done."""
        import ray

        done, _ = ray.wait([self.result_ref], timeout=0)
        report = self._from_controller(self.controller.progress.remote(self._seen))
        for record in report["steps"]:
            self._record_step(record)
            if self.evaluations and self.evaluations.due(record["step"]):
                self.evaluations.request(record["step"], record["version"])
        if self.evaluations:
            self._show_evaluations()
        self.progress.waits(report)
        self._show_recoveries(report)
        self.traces.poll()
        return bool(done)

    def _from_controller(self, ref):
        """A controller call's answer; its death said as such (Ray's own text guesses at causes)."""
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as error:
            raise ControllerLost(f"{self.prefix}the controller died: its process ended "
                                 f"({exit_detail(error)})") from None

    def _record_step(self, record: dict) -> None:
        self.progress.step(record)  # written before counted: a stop signal in between repeats it, never loses it
        self._seen += 1

    def drain_steps(self, timeout_s: float) -> None:
        """Record the steps finished since the last poll (during a stop, the last ones)."""
        import ray

        if self.controller is not None and self.progress is not None:
            for record in ray.get(self.controller.progress.remote(self._seen), timeout=timeout_s)["steps"]:
                self._record_step(record)

    def _show_recoveries(self, report: dict) -> None:
        """Each actor replaced since the last poll, said once; its trace is drained from now on."""
        for name, actor in report.get("replaced", {}).items():
            self.traces.replace(name, actor)
        recoveries = report.get("recoveries", [])
        for recovery in recoveries[self._recoveries_shown:]:
            self.say(f"recovered: {recovery['stage']}-{recovery['rank']} died ({recovery['cause']}); "
                     f"a new actor took its place in {recovery['seconds']:.1f}s and the work it held was redone")
        self._recoveries_shown = len(recoveries)
        losses = report.get("losses", [])
        for loss in losses[self._losses_shown:]:
            self.say(f"lost: {loss['stage']}-{loss['rank']} died and could not be replaced ({loss['cause']}); "
                     "the run goes on without it (its work is dropped as worker_died)")
        self._losses_shown = len(losses)

    def complete(self) -> int:
        """The controller's summary (its error raised as PipelineStalled /
        StepFailed), the final evaluation, summary.json and the final table."""
        summary = self._from_controller(self.result_ref)
        said = save_final_checkpoint(self, summary["version"])  # every finished run can be exported
        if said:
            self.say(said)
        if self.evaluations:
            if self.evaluations.due_at_end(summary["steps"]):
                self.evaluations.request(step=summary["steps"], version=summary["version"])
            self._show_evaluations(wait=True)
        summary.update(evaluation_summary(self.evaluations.done if self.evaluations else [], summary["steps"]))
        if self.evaluations and self.evaluations.timed_out:
            summary["eval_timeouts"] = self.evaluations.timed_out
        if self.evaluations and self.evaluations.failed:
            summary["eval_failures"] = self.evaluations.failed
        summary["wall_clock_s"] = time.monotonic() - self.started
        summary["train_loop_s"] = time.monotonic() - self.progress.started
        self.progress.final_table(self.write_summary(summary), self.run_dir)
        return 0

    def request_stop(self) -> None:
        if self.controller is not None:
            self.controller.request_stop.remote()

    def end_actors(self, timeout_s: float = 15.0) -> None:
        """Kill this pipeline's actors (the controller's replacements die with
        it) and wait until their names are free, so that a restart on the
        same cluster can create them again."""
        import ray

        actors = {self.actor_name(name, rank): actor for name, handles in self.own_handles().items()
                  for rank, actor in enumerate(handles)}
        if self.controller is not None:
            actors[f"{self.prefix}controller"] = self.controller
        if self._has_evaluator_actor():
            actors[f"{self.prefix}evaluator"] = self.evaluations.actor
        for actor in actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor)
        deadline = time.monotonic() + timeout_s
        for name in actors:
            while time.monotonic() < deadline and _name_taken(name):
                time.sleep(0.1)

    def write_summary(self, summary: dict | None = None, error: BaseException | None = None,
                      stop: dict | None = None, timeout_s: float = 30.0, evaluations: dict | None = None) -> dict:
        """summary.json, on every exit path: ``summary`` or else the
        controller's (it answers after a failure too), how the run ended
        (``error``: what ended it on the driver's side; ``stop``: the signal
        that stopped it) and the whole run's accounting from the journal,
        resumes included."""
        from rldsl.runtime.ray_lowering.run_summary import write_summary

        summary = summary if summary is not None else self._controller_summary(timeout_s)
        if summary is not None:
            summary.setdefault("wall_clock_s", time.monotonic() - self.started)
            if evaluations:  # a stop's: those finished, and those skipped
                summary.update(evaluation_summary(evaluations["done"], summary.get("steps", 0)))
                if evaluations["skipped"]:
                    summary["eval_skipped"] = evaluations["skipped"]
            if self.scheduler is not None:
                summary["gpu_sharing"] = self._lease_figures(timeout_s)
        self.summary = write_summary(self.run_dir, summary, self.pipe.name, root_cause(error) if error else None,
                                     stop)
        if self.summary.get("not_written"):
            self.say(f"summary.json could not be written: {self.summary['not_written']}")
        return self.summary

    def _lease_figures(self, timeout_s: float) -> dict:
        """GPU-seconds held and waited, from the lease scheduler (or why not)."""
        import ray

        try:
            return ray.get(self.scheduler.stats.remote(self.pipe.name), timeout=timeout_s)
        except ray.exceptions.RayError as err:
            return {"error": f"the GPU lease scheduler did not answer: {root_cause(err)}"}

    def _controller_summary(self, timeout_s: float) -> dict | None:
        import ray

        if self.controller is None:
            return None
        try:
            return ray.get(self.controller.summary.remote(), timeout=timeout_s)
        except ray.exceptions.RayError:  # its actor died, or Ray is going down
            return None

    def resume_info(self) -> dict | None:
        return None if not self.resume else {k: v for k, v in self.resume.items() if k != "dir"}

    def _receivers(self) -> list:
        """(spec, actor) of every rank of the stages that receive weights."""
        targets = self.pipe.weight_receivers()
        return [pair for name in sorted(targets) for pair in zip(self.specs[name], self.handles[name])]



def _resume_point(run_dir: Path) -> dict:
    from rldsl.runtime.ray_lowering.checkpoint import PROGRESS_FILE, latest_complete

    found = latest_complete(run_dir)
    if found is None:
        raise ResumeError(f"{run_dir} has no complete checkpoint (checkpoints/v*/ with trainer.json and progress.json)")
    progress = json.loads((found / PROGRESS_FILE).read_text())
    return {"dir": found, **progress}


def _name_taken(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def _logged_config(pipe: PipelinePlan) -> dict:
    """The settings a metric logger records with the run (what differs between runs one compares)."""
    train = pipe.stage(pipe.batch.train_stage)
    return {"pipeline": pipe.name, "trainer_engine": train.engine.name, "prompts_per_step": pipe.batch.prompts_per_step,
            "samples_per_prompt": pipe.batch.samples_per_prompt, "max_lag": pipe.staleness.max_lag,
            **{f"train.{k}": v for k, v in train.settings.items() if isinstance(v, (int, float, str, bool))}}


def _entries(directory: Path) -> set[str]:
    """The names in ``directory`` (none when it does not exist yet)."""
    return {path.name for path in directory.iterdir()} if directory.is_dir() else set()
