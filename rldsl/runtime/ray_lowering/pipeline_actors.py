"""A pipeline's stage actors (``PipelineActors``, mixed into PipelineDriver):
one per stage rank, each GPU rank in its bundle, and the stages that run on
actors another stage started: a frozen reference scored by its trainer's
ranks, and a generate stage `served_by` another pipeline's generator."""

from __future__ import annotations

from dataclasses import replace

from rldsl.runtime.ray_lowering.actor_process import run_actor
from rldsl.runtime.ray_lowering.cluster import ACTOR_NUM_CPUS
from rldsl.runtime.ray_lowering.stage_handles import reward_calls_per_worker
from rldsl.runtime.ray_lowering.supervision import ActorSpec


class PipelineActors:
    """Needs ``pipe``, ``settings``, ``prefix``, ``checkpoint``, ``run_dir``,
    ``handles``, ``specs``, ``tenants``, ``borrowed``, ``controller`` and the
    evaluator (PipelineDriver, PipelineEvaluations)."""

    def create_actors(self, spec: dict, reservation) -> None:
        """One actor per stage rank, GPU ranks in their bundle of ``reservation``
        (placement.Reservation); not yet waited for. A frozen reference its
        trainer scores takes the trainer's actors; a stage `served_by`
        another pipeline gets that pipeline's in ``borrow``, and the
        evaluator and controller come after (``start_controller``)."""

        from rldsl.runtime.ray_lowering import workers as w
        from rldsl.runtime.ray_lowering.trainer_worker import TrainerWorker
        from rldsl.runtime.ray_lowering.judge import JudgeWorker  # a reward stage with a reward model

        self.run_dir.mkdir(parents=True, exist_ok=True)  # RUN_DIR/<pipeline> when several share the run
        classes = {"generate": w.GeneratorWorker, "reward": w.RewardWorker, "logprob": w.LogprobWorker,
                   "train": TrainerWorker}
        for stage in self.pipe.stages:
            if stage.kind == "sync" or stage.served_by or stage.on_trainer:
                continue
            worker = JudgeWorker if stage.kind == "reward" and stage.model else classes[stage.kind]
            actor_class = run_actor(worker)
            self.handles[stage.name], self.specs[stage.name] = [], []
            for rank in stage.ranks:
                args = [self.pipe, stage, rank.index, spec]
                if stage.kind in ("train", "logprob"):  # each stage is its own process group
                    args.append({"group": f"{self.prefix}{stage.name}", "rank": rank.index,
                                 "world_size": len(stage.ranks), "store_dir": reservation.store_dir})
                if stage.kind == "train":
                    args.append(self.checkpoint)
                options = self.actor_options(stage.name, rank.index, bool(rank.gpus), reservation)
                if stage.kind == "generate":  # one thread per group in flight, plus pushes and control calls
                    options["max_concurrency"] = sum(p.generator_threads() for p in [self, *self.tenants])
                    if self.tenants:
                        args.append([(t.pipe, t.pipe.stage(t.served_stage())) for t in self.tenants])
                if stage.kind == "reward":  # a call per reward process, so one hung sample holds up only its own
                    options["max_concurrency"] = reward_calls_per_worker(stage) + 2
                self.handles[stage.name].append(actor_class.options(**options).remote(*args))
                # a generator serving other pipelines is not remade: their controllers hold its handle
                self.specs[stage.name].append(ActorSpec(stage.name, stage.kind, rank.index, worker, tuple(args),
                                                        options, _replaceable(stage) and not self.tenants))
        for stage in self.pipe.stages:  # a frozen reference its trainer's ranks score (StagePlan.on_trainer)
            if stage.on_trainer:
                self._borrow(stage.name, self.handles[stage.on_trainer],
                             [replace(s, stage=stage.name, kind="logprob") for s in self.specs[stage.on_trainer]])

    def served_stage(self) -> str | None:
        """This pipeline's generate stage that another pipeline's generator serves (`served_by`), if any."""
        return next((s.name for s in self.pipe.stages if s.served_by), None)

    def server(self) -> str | None:
        """The pipeline whose generator serves this one, if any."""
        stage = self.served_stage()
        return self.pipe.stage(stage).served_by.partition("/")[0] if stage else None

    def borrow(self, server: "PipelineActors") -> None:
        """The actors of ``server``'s generator for this pipeline's stage `served_by` it; calls go through
        their ``serve`` under this pipeline's name, and a death is not repaired (ActorSpec.tenant)."""
        name, own = self.served_stage(), self.pipe.stage(self.served_stage()).served_by.partition("/")[2]
        self._borrow(name, server.handles[own], [replace(s, stage=name, tenant=self.pipe.name)
                                                 for s in server.specs[own]])

    def _borrow(self, stage: str, handles: list, specs: list[ActorSpec]) -> None:
        """``stage`` runs on actors another stage started (never replaced for it)."""
        self.borrowed.add(stage)
        self.handles[stage] = list(handles)
        self.specs[stage] = [replace(spec, replaceable=False) for spec in specs]

    def generator_threads(self) -> int:
        """Calls one generator replica serves at once for this pipeline: a thread per group in flight, plus
        pushes and control calls."""
        replicas = sum(len(s.ranks) for s in self.pipe.stages if s.kind == "generate")
        return self.settings.replica_concurrency(replicas) + 4 + (self.pipe.eval_on == "generators")

    def actor_options(self, stage: str, rank: int, uses_gpus: bool, reservation) -> dict:
        """Ray options of one rank's actor: its name, and its bundle for a GPU rank."""
        name = self.actor_name(stage, rank)
        options = {"num_cpus": ACTOR_NUM_CPUS, "name": name}
        if uses_gpus:
            options.update(reservation.actor_options(reservation.slot(name)))
        return options

    def actor_name(self, stage: str, rank: int) -> str:
        return f"{self.prefix}{stage}-{rank}"

    def ready_calls(self) -> dict:
        """``ready`` calls of every actor -> the stage it belongs to."""
        calls = {a.ready.remote(): f"{self.prefix}{name}" for name, actors in self.own_handles().items()
                 for a in actors}
        if self._has_evaluator_actor():
            calls[self.evaluations.actor.ready.remote()] = f"{self.prefix}evaluator"
        if self.controller is not None:
            calls[self.controller.ready.remote()] = f"{self.prefix}controller"
        return calls

    def own_handles(self) -> dict[str, list]:
        """The stages' actors this pipeline started (not those it borrows, `served_by`)."""
        return {name: handles for name, handles in self.handles.items() if name not in self.borrowed}


def _replaceable(stage) -> bool:
    """A stage rank whose actor can be started afresh mid-run: it holds no
    training state and belongs to no process group a new rank could not join."""
    if stage.kind == "train":
        return False
    return stage.kind != "logprob" or len(stage.ranks) == 1
