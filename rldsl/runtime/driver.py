"""The driver process of `rldsl run`: actors up, progress shown, run dir written."""

from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

from rldsl.plan import ExecutionPlan, PipelinePlan
from rldsl.runtime.progress import Progress
from rldsl.runtime.settings import RunSettings

_ACTOR_CPUS = 0.25  # logical: TransferQueue and our actors must never starve each other on a small Ray
_READY_TIMEOUT_S = 600.0


class Driver:
    def __init__(self, plan: ExecutionPlan, pipe: PipelinePlan, settings: RunSettings, run_dir: Path,
                 address: str | None = None, resume: bool = False, started: float | None = None):
        self.plan, self.pipe, self.settings, self.address = plan, pipe, settings, address
        self.started = started if started is not None else time.monotonic()  # the whole run, start-up included
        self.run_dir = run_dir.resolve()  # actors write checkpoints here, whatever their working directory
        self.trainer_engine = pipe.stage(pipe.batch.train_stage).engine.name
        self.previous_evals: list[dict] = _previous_evals(self.run_dir) if resume else []
        self.evaluations = None  # EvaluationSchedule once the evaluator runs
        self.resume = _resume_point(self.run_dir) if resume else None
        self.checkpoint = {"run_dir": str(self.run_dir), "every": pipe.run.checkpoint_every}

    # ------------------------------------------------------------ lifecycle

    def run(self) -> int:
        import ray

        from rldsl.runtime.cluster import logical_cpus_needed, ray_session

        ranks = sum(len(s.ranks) for s in self.pipe.stages) + 1 + self.pipe.evaluates  # + controller, evaluator
        cluster = self.plan.cluster
        gpus = cluster.nodes * cluster.gpus_per_node
        self._say(f"starting Ray: {ranks} actors, {gpus} GPUs ({'logical' if self.address is None else 'cluster'})")
        with ray_session(self.address, logical_cpus_needed(ranks * _ACTOR_CPUS), gpus,
                         namespace=f"rldsl-{self.pipe.name}") as session:
            self._prepare_models()
            dataplane = self._dataplane(session)
            workers = self._start_workers(dataplane.spec)
            if self.resume:
                self._restore(workers)
            if self.settings.colocated:  # generation comes first: an offloading trainer starts offloaded
                ray.get([t.sleep.remote() for t in workers[self.pipe.batch.train_stage]])
            return self._drive(workers, dataplane)

    def _say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def _prepare_models(self) -> None:
        """Build the warm start (cached) once here rather than in every actor."""
        model = next(m for m in self.pipe.models if m.name == self.pipe.stage(self.pipe.batch.train_stage).model)
        if self.trainer_engine != "torch" or not model.source.startswith("builtin:"):
            return  # local models load in the actors; their errors are reported per stage
        from rldsl.runtime.engine_factory import load_policy

        started = time.monotonic()
        self._say(f"loading {model.source} (the first run builds a cached warm start)")
        load_policy(model, self.pipe, self.pipe.run.seed)
        self._say(f"model ready in {time.monotonic() - started:.1f}s")

    def _dataplane(self, session):
        from rldsl.runtime.dataplane import connect_dataplane

        plane = connect_dataplane({"backend": "transferqueue", "storage_units": 1})
        session.add_cleanup(plane.close)
        return plane

    # --------------------------------------------------------------- actors

    def _start_workers(self, spec: dict) -> dict[str, list]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rldsl.runtime import workers as w
        from rldsl.runtime.cluster import create_placement_group

        classes = {"generate": w.GeneratorWorker, "reward": w.RewardWorker, "logprob": w.LogprobWorker,
                   "train": w.TrainerWorker}
        groups = self._placement_groups(create_placement_group)
        handles: dict[str, list] = {}
        for stage in self.pipe.stages:
            if stage.kind == "sync":
                continue
            actor_class = ray.remote(classes[stage.kind])
            dist = self._dist_info()  # each stage is its own process group (trainer, megatron logprob)
            handles[stage.name] = []
            for rank in stage.ranks:
                options = {"num_cpus": _ACTOR_CPUS, "name": f"{stage.name}-{rank.index}"}
                if rank.gpus:  # colocated ranks share a GPU bundle; their CPU is not reserved in it
                    pg, bundle = groups[(rank.node, rank.gpus[0])]
                    options["num_cpus"] = 0
                    options["num_gpus"] = rank.gpu_fraction * len(rank.gpus)
                    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, bundle)
                args = [self.pipe, stage, rank.index, spec]
                if stage.kind in ("train", "logprob"):
                    args.append({**dist, "rank": rank.index, "world_size": len(stage.ranks)})
                if stage.kind == "train":
                    args.append(self.checkpoint)
                handles[stage.name].append(actor_class.options(**options).remote(*args))
        evaluator = self._start_evaluator()
        self._wait_ready({**handles, **({"evaluator": [evaluator]} if evaluator else {})})
        return handles

    def _start_evaluator(self):
        """The held-out evaluator: one more weight receiver, on the CPU."""
        import ray

        from rldsl.runtime.evaluation import EvaluationSchedule, Evaluator

        if not self.pipe.evaluates:
            return None
        # threads to spare: evaluations waiting for a version must never starve the push that brings it
        actor = ray.remote(Evaluator).options(num_cpus=_ACTOR_CPUS, max_concurrency=4, name="evaluator")
        handle = actor.remote(self.pipe)
        self.evaluations = EvaluationSchedule(handle, self.pipe.run.eval_every, self.settings.steps,
                                              self.previous_evals)
        return handle

    def _placement_groups(self, create_placement_group) -> dict[tuple[int, int], tuple]:
        """One STRICT_PACK group per node holding that node's planned GPUs."""
        used: dict[int, set[int]] = {}
        for stage in self.pipe.stages:
            for rank in stage.ranks:
                used.setdefault(rank.node, set()).update(rank.gpus)
        out = {}
        for node, gpus in sorted(used.items()):
            if not gpus:
                continue
            ordered = sorted(gpus)
            pg = create_placement_group([{"GPU": 1.0} for _ in ordered], "STRICT_PACK",
                                        name=f"{self.pipe.name}-node{node}", timeout_s=60.0)
            out.update({(node, gpu): (pg, i) for i, gpu in enumerate(ordered)})
        return out

    def _dist_info(self) -> dict:
        with socket.socket() as sock:  # a free port for the stage's rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return {"master": f"127.0.0.1:{port}"}

    def _wait_ready(self, handles: dict[str, list]) -> None:
        import ray

        pending = {a.ready.remote(): name for name, actors in handles.items() for a in actors}
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise TimeoutError(f"stage actors not ready after {_READY_TIMEOUT_S:.0f}s: "
                                   + ", ".join(sorted(set(pending.values()))))
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as err:  # the actor's own start-up error, named, without Ray's wrapping
                raise StageStartError(f"stage `{pending[done[0]]}` failed to start: {_root_cause(err)}") from None
            pending.pop(done[0])

    # --------------------------------------------------------------- resume

    def _restore(self, handles: dict[str, list]) -> None:
        """Trainer ranks reload the checkpoint; its weights go to every receiver."""
        import ray

        trainers = handles[self.pipe.batch.train_stage]
        try:
            version = ray.get([t.load_checkpoint.remote(str(self.resume["dir"])) for t in trainers])[0]
        except ray.exceptions.RayError as err:  # e.g. a checkpoint of another layout: say so, no remote traceback
            raise ResumeError(f"could not restore the trainer from {self.resume['dir']}: {_root_cause(err)}") from None
        count = ray.get([t.prepare_buckets.remote(self.settings.sync_bucket_bytes) for t in trainers])[0]
        for index in range(count):
            bucket = trainers[0].bucket.remote(index)
            ray.get([r.update_weights.remote(bucket, version, index == count - 1)
                     for r in self._receivers(handles) + self._observers()])
        self._say(f"resumed from {self.resume['dir'].name}: version {version}, "
                  f"{self.resume['steps_done']} steps done")

    # ---------------------------------------------------------------- drive

    def _drive(self, handles: dict[str, list], dataplane) -> int:
        import ray

        from rldsl.runtime.controller_actor import ControllerActor

        done_before = self.resume["steps_done"] if self.resume else 0
        settings = replace(self.settings, steps=self.settings.steps - done_before)
        if settings.steps <= 0:
            self._say(f"nothing to do: {done_before} of {self.settings.steps} steps are done")
            return 0
        self.progress = progress = Progress(self.settings, self.run_dir)
        if self.evaluations and not self.resume:
            self.evaluations.request(step=0, version=0)
        controller = ray.remote(ControllerActor).options(num_cpus=_ACTOR_CPUS, name="controller").remote(
            settings, self.pipe, handles, self._receivers(handles), dataplane.spec, self.checkpoint, self.resume_info(),
            self._observers())
        result_ref = controller.run.remote()
        try:
            with progress:
                self._follow(controller, result_ref, progress)
        except KeyboardInterrupt:
            return self._checkpoint_on_interrupt(handles, controller, result_ref)
        summary = ray.get(result_ref)  # raises PipelineStalled / StepFailed with the controller's words
        if self.evaluations:
            self.evaluations.request(step=summary["steps"], version=summary["version"])
            self._show_evaluations(wait=True)
        return self._finish(summary, progress)

    def _follow(self, controller, result_ref, progress: Progress) -> None:
        import ray

        seen = 0
        while True:
            done, _ = ray.wait([result_ref], timeout=0.5)
            report = ray.get(controller.progress.remote(seen))
            for record in report["steps"]:
                seen += 1
                progress.step(record)
                if self.evaluations and self.evaluations.due(record["step"]):
                    self.evaluations.request(record["step"], record["version"])
            if self.evaluations:
                self._show_evaluations()
            progress.waits(report["waits"])
            if done:
                return

    def resume_info(self) -> dict | None:
        return None if not self.resume else {k: v for k, v in self.resume.items() if k != "dir"}

    def _checkpoint_on_interrupt(self, handles: dict[str, list], controller, result_ref) -> int:
        """Stop at the next safe point (the trainer call in flight completes,
        an open step is aborted), then save the trainer and the progress."""
        import ray

        self._say("interrupted: stopping after the trainer call in flight (Ctrl-C again quits at once)")
        controller.request_stop.remote()
        try:
            ray.get(result_ref)
        except ray.exceptions.RayError as err:
            self._say(f"interrupted; the run failed while stopping: {_root_cause(err)}")
            return 130
        trainers = handles[self.pipe.batch.train_stage]
        if not ray.get(trainers[0].can_checkpoint.remote()):
            self._say(f"interrupted: the {self.trainer_engine} trainer keeps no checkpoints")
            return 130
        version = ray.get([t.save_checkpoint.remote() for t in trainers])[0]
        if ray.get(controller.save_progress.remote(version)):
            self._say(f"interrupted: checkpoint saved at version {version}; continue with "
                      f"`rldsl run --resume {self.run_dir}`")
        else:
            self._say("interrupted before a step finished in this run: nothing new to checkpoint")
        return 130

    def _receivers(self, handles: dict[str, list]) -> list:
        targets = {e.dst for e in self.pipe.edges if e.kind == "weights"}
        return [a for name in sorted(targets) for a in handles[name]]

    def _observers(self) -> list:
        """Weight receivers outside the sync edges: the evaluator."""
        return [self.evaluations.actor] if self.evaluations else []

    def _show_evaluations(self, wait: bool = False) -> None:
        for result in self.evaluations.collect(wait):
            self.progress.eval(result["step"], result["accuracy"])
            text = (f"eval @ step {result['step']}: held-out accuracy {result['accuracy']:.3f} "
                    f"({result['prompts']} prompts, greedy, weights v{result['version']})")
            if result["step"] == 0 or wait:
                self._say(text)
            else:
                self.progress.note(text)

    def _finish(self, summary: dict, progress: Progress) -> int:
        evals = self.evaluations.done if self.evaluations else []
        if evals:
            summary["eval_start"] = evals[0]["accuracy"]
            summary["eval_end"] = evals[-1]["accuracy"]
            summary["evals"] = evals
        summary["wall_clock_s"] = time.monotonic() - self.started
        summary["train_loop_s"] = time.monotonic() - progress.started
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        progress.final_table(summary, self.run_dir)
        return 0



def _resume_point(run_dir: Path) -> dict:
    from rldsl.runtime.checkpoint import PROGRESS_FILE, latest_complete

    found = latest_complete(run_dir)
    if found is None:
        raise ResumeError(f"{run_dir} has no complete checkpoint (checkpoints/v*/ with trainer.json and progress.json)")
    progress = json.loads((found / PROGRESS_FILE).read_text())
    return {"dir": found, **progress}


def _previous_evals(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "accuracy": r["accuracy"]} for r in records if r.get("eval")]


class ResumeError(RuntimeError):
    pass


class StageStartError(RuntimeError):
    pass


def _root_cause(err: BaseException) -> str:
    """The innermost error's type and message, not Ray's remote traceback."""
    cause = getattr(err, "cause", None) or err.__cause__
    while cause is not None and (getattr(cause, "cause", None) or cause.__cause__) is not None:
        cause = getattr(cause, "cause", None) or cause.__cause__
    cause = cause or err
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"
