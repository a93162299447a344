"""Resolved program + placement -> ExecutionPlan (JSON values only)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl, Program
from rldsl.compiler.gpu_defaults import eval_on_default, run_defaults
from rldsl.compiler.ir import generations
from rldsl.compiler.placement import Placement, StagePlacement, reference_on_trainer
from rldsl.compiler.reward_types import RewardComponent
from rldsl.compiler.rules.launch import response_cap
from rldsl.compiler.schema import JUDGE_KEYS, SERVER_KEYS, stage_engine_args
from rldsl.compiler.types import EngineSpec, GpuRequest, LossSpec, Ref
from rldsl.plan import (
    ADVANTAGE_NORMALISATION, BatchPlan, ClusterPlan, DatasetPlan, EdgePlan, EnginePlan, EnvironmentPlan,
    ExecutionPlan, LoraPlan, ModelPlan, NodeGpus, PipelinePlan, RankPlan, RunPlan, SharingPlan, StagePlan,
    StalenessPlan, lora_default_targets,
)


def lower(program: Program, contexts: list[Context], placement: Placement, params: dict[str, int | None],
          warnings: list[str], source_sha256: str, base_dir: Path = Path(".")) -> ExecutionPlan:
    cluster = program.cluster
    return ExecutionPlan(
        cluster=ClusterPlan(cluster["nodes"], cluster["gpus_per_node"], cluster.get("gpu"),
                            _int_or_none(cluster.get("gpu_memory")), cluster.get("cpus_per_node")),
        pipelines=_served([_pipeline(ctx, placement, params, base_dir) for ctx in contexts]),
        source_file=program.filename,
        source_sha256=source_sha256,
        warnings=warnings,
    )


def _served(pipelines: list[PipelinePlan]) -> list[PipelinePlan]:
    """A generate stage `served_by` another pipeline: that pipeline's generator (its engine, ranks and sampling
    settings) with this stage's own name, model and per-request keys; ``served_by`` names it `pipeline/stage`."""
    by_name = {p.name: p for p in pipelines}
    for pipe in pipelines:
        for index, stage in enumerate(pipe.stages):
            owner_name = stage.settings.get("served_by") if stage.kind == "generate" else None
            if owner_name is None:
                continue
            server = next(s for s in by_name[owner_name].stages if s.kind == "generate")
            own = {k: v for k, v in stage.settings.items() if k not in SERVER_KEYS}
            pipe.stages[index] = replace(server, name=stage.name, model=stage.model, colocated_with=[],
                                         settings={**server.settings, **own,
                                                   "served_by": f"{owner_name}/{server.name}"})
    return pipelines


def _on_trainer(pipe, decl: Decl, placement: Placement, stage: StagePlan) -> StagePlan:
    """A frozen reference its trainer scores with the LoRA adapters off (``on_trainer``: no actors)."""
    trainer = reference_on_trainer(pipe, decl, placement)
    return replace(stage, settings={**stage.settings, "on_trainer": trainer}) if trainer else stage


def _int_or_none(value):
    return None if value is None else int(value)


def _float_or_none(value):
    return None if value is None else float(value)


def _pipeline(ctx: Context, placement: Placement, params: dict[str, int | None], base_dir: Path) -> PipelinePlan:
    pipe, sizing = ctx.pipe, ctx.sizing()
    staleness, run = pipe.block("staleness"), pipe.block("run")
    residents = placement.residents()  # once: per GPU it made `check` quadratic in the cluster's size
    return PipelinePlan(
        name=pipe.name,
        models=[ModelPlan(m.name, _anchored(m["source"], base_dir), params.get(f"{pipe.name}/{m.name}"), m.get("dtype"),
                          bool(m.get("chat_template")), _lora(m))
                for m in pipe.models.values()],
        datasets=[_dataset(d, base_dir, eval_on_default(ctx.program, d, pipe.stages_of("generate")))
                  for d in pipe.datasets.values()],
        stages=[_on_trainer(pipe, s, placement,
                            _fit_responses(ctx, s, _stage(s, placement.of(pipe.name, s.name), placement, residents,
                                                          base_dir)))
                for s in pipe.stages.values()],
        edges=[EdgePlan(u, v, d["kind"], list(d.get("fields", ())), d.get("sync"))
               for u, v, d in ctx.graph.edges(data=True)],
        generations=generations(ctx.graph),
        staleness=StalenessPlan(staleness["max_lag"], staleness["order"], staleness["too_stale"],
                                _float_or_none(staleness.get("max_ahead"))),
        batch=BatchPlan(sizing.train_stage, sizing.prompts_per_step, sizing.samples_per_prompt, sizing.global_batch,
                        sizing.micro_batch, sizing.capacity, sizing.max_inflight, sizing.ppo_epochs),
        run=_run(run, sizing.prompts_per_step * sizing.samples_per_prompt, run_defaults(ctx.program, run)),
        sharing=SharingPlan(float(pipe.block("placement")["weight"]), int(pipe.block("placement")["priority"])),
        environments=[_environment(e, base_dir) for e in pipe.environments.values()],
    )


def _environment(decl: Decl, base_dir: Path) -> EnvironmentPlan:
    return EnvironmentPlan(decl.name, _anchored_spec(decl["fn"], base_dir), decl["max_turns"], decl["max_tokens"],
                           float(decl["timeout"]), decl["processes"],
                           [_anchored_spec(tool, base_dir) for tool in decl["tools"]],
                           None if decl["tool_format"] == "none" else decl["tool_format"],
                           decl["max_observation_tokens"], float(decl["straggler"]))


def _run(run: Decl, rollout_batch: int, gpu_defaults: dict) -> RunPlan:
    """Steps as written, or from `samples` (whole steps, rounded up); a run
    in `epochs` gets its steps when the runtime has read the dataset. A
    `steps` written beside either is a cap (`max_steps`): the run ends at
    whichever bound it reaches first. ``gpu_defaults``: the keys a GPU
    program left out, with their GPU values (gpu_defaults.py)."""
    value = lambda key: gpu_defaults.get(key, run[key])  # noqa: E731
    epochs, samples = run.get("epochs", 0), int(run.get("samples", 0))
    max_steps = run["steps"] if (epochs or samples) and run.explicit("steps") else 0
    steps = -(-samples // rollout_batch) if samples else 0 if epochs else run["steps"]
    if samples and max_steps:
        steps = min(steps, max_steps)
    return RunPlan(steps, run["seed"], run["eval_every"], value("checkpoint_every"), run["watchdog"], run["restarts"],
                   epochs, samples, list(run["log"]), value("keep_checkpoints"), eval_timeout_s=value("eval_timeout"),
                   max_steps=max_steps, eval_at_start=run["eval_at_start"], eval_at_end=run["eval_at_end"])


def _dataset(decl: Decl, base_dir: Path, eval_on: str | None = None) -> DatasetPlan:
    """`source` is the first of `sources` when a mixture is written; every
    path is anchored to the .rlp file. ``eval_on``: a GPU program's default (gpu_defaults.py)."""
    options = _settings(decl, skip=("source",))
    if eval_on:
        options["eval_on"] = eval_on
    sources = [_anchored(s, base_dir) for s in decl.get("sources") or (decl["source"],)]
    if decl.get("sources"):
        options["sources"] = sources
    if decl.get("eval_source"):
        options["eval_source"] = _anchored(decl["eval_source"], base_dir)
    return DatasetPlan(decl.name, sources[0], _anchored_function(options, "eval_metric", base_dir))


def _lora(model) -> LoraPlan | None:
    rank = model.get("lora_rank") or 0
    if not rank:
        return None
    alpha = model.get("lora_alpha")
    targets = model.get("lora_targets")
    return LoraPlan(rank, float(2 * rank if alpha is None else alpha),
                    list(targets) if targets else lora_default_targets(model["source"]))


def _anchored(source: str, base_dir: Path) -> str:
    """`hf:` and `jsonl:` paths are relative to the .rlp file; the plan holds
    them absolute, so actors find them whatever their working directory."""
    scheme, sep, path = source.partition(":")
    if scheme not in ("hf", "jsonl") or not sep or Path(path).is_absolute():
        return source
    return f"{scheme}:{(base_dir / path).resolve()}"


def _anchored_function(settings: dict, key: str, base_dir: Path) -> dict:
    """A `module:function` whose module sits beside the .rlp file is found
    there whatever the working directory (`rldsl.rewards.load_reward` reads
    the `@DIR` suffix); an installed module is left to the import system."""
    spec = settings.get(key)
    if isinstance(spec, list):  # a reward stage's named components
        return {**settings, key: [{**part, "fn": _anchored_spec(part["fn"], base_dir)} for part in spec]}
    return {**settings, key: _anchored_spec(spec, base_dir)} if spec else settings


def _anchored_functions(settings: dict, base_dir: Path) -> dict:
    """A reward stage's functions: `fn`, and a reward model's `template` and `parse`."""
    for key in ("fn", "template", "parse"):
        settings = _anchored_function(settings, key, base_dir)
    return settings


def _anchored_spec(spec: str, base_dir: Path) -> str:
    module, sep, _ = spec.partition(":")
    top = module.split(".")[0]
    if sep and top and "@" not in spec and _beside(base_dir, top):
        return f"{spec}@{base_dir.resolve()}"
    return spec


def _beside(base_dir: Path, module: str) -> bool:
    try:
        return (base_dir / f"{module}.py").is_file() or (base_dir / module).is_dir()
    except OSError:  # a name too long for a file is no file
        return False


def _stage(stage: Decl, sp: StagePlacement | None, placement: Placement,
           residents: dict[int, list[StagePlacement]], base_dir: Path = Path(".")) -> StagePlan:
    engine = stage.get("engine") if stage.stage_kind != "reward" or stage.get("model") else None
    ranks = []
    for rank in (sp.ranks if sp else ()):
        node = placement.node_of(rank.gpus[0]) if rank.gpus else 0
        fraction = 1.0 / max(len(residents.get(g, ())) or 1 for g in rank.gpus) if rank.gpus else 0.0
        here = [placement.local(g) for g in rank.gpus if placement.node_of(g) == node]
        ranks.append(RankPlan(rank.index, node, here, rank.tp_rank, rank.pp_rank, rank.dp_rank, fraction,
                              _remote(rank.gpus, node, placement)))
    return StagePlan(
        name=stage.name,
        kind=stage.stage_kind,
        engine=EnginePlan(engine.name, stage_engine_args(engine, stage.stage_kind)) if engine else None,
        model=stage["model"].name if stage.get("model") else None,
        settings=_anchored_functions(_derived(stage, _settings(stage, skip=("engine", "model", "gpus", "colocate"))),
                                     base_dir),
        ranks=ranks,
        tp=sp.tp if sp else 1, pp=sp.pp if sp else 1, dp=sp.dp if sp else 1,
        colocated_with=_sharing(sp, residents) if sp else [],
    )


def _fit_responses(ctx: Context, decl: Decl, stage: StagePlan) -> StagePlan:
    """A `max_new_tokens` past what the model's context holds after the longest prompt (the builtin
    model's 64 positions), cut to fit: a longer response would stop the run (RLP117 where it is written)."""
    cap = response_cap(ctx, decl)
    if cap is not None:
        stage.settings["max_new_tokens"] = cap
        stage.settings["min_new_tokens"] = min(stage.settings.get("min_new_tokens", 0), cap)
    return stage


def _remote(gpus: tuple[int, ...], node: int, placement: Placement) -> list[NodeGpus]:
    """A replica's GPUs beyond its actor's node (only vLLM pp > 1 crosses nodes)."""
    by_node: dict[int, list[int]] = {}
    for g in gpus:
        if placement.node_of(g) != node:
            by_node.setdefault(placement.node_of(g), []).append(placement.local(g))
    return [NodeGpus(n, local) for n, local in sorted(by_node.items())]


def _derived(stage: Decl, settings: dict) -> dict:
    """Defaults that depend on other keys, written out so the runtime reads no language rules."""
    if stage.stage_kind == "train" and "normalize" not in settings:
        settings["normalize"] = ADVANTAGE_NORMALISATION[settings["advantage"]]
    if stage.stage_kind == "reward" and not stage.get("model"):  # a reward without a model: its plan as before
        settings = {k: v for k, v in settings.items() if k not in JUDGE_KEYS}
    return settings


def _sharing(sp: StagePlacement, residents: dict[int, list[StagePlacement]]) -> list[str]:
    """Every stage that shares a GPU with this one: colocated, partially
    overlapping, or of another pipeline (written `pipeline/stage`)."""
    names = set()
    for gpu in sp.gpus:
        for other in residents[gpu]:
            if other is not sp:
                names.add(other.stage if other.pipeline == sp.pipeline else f"{other.pipeline}/{other.stage}")
    return sorted(names)


def _settings(decl: Decl, skip: tuple[str, ...]) -> dict:
    return {k: _json(s.value) for k, s in decl.settings.items() if k not in skip and s.value is not None}


def _json(value):
    # the typed values are NamedTuples: match them before plain tuples
    if isinstance(value, Ref):
        return value.name
    if isinstance(value, (LossSpec, EngineSpec)):
        return {"name": value.name, **value.args}
    if isinstance(value, GpuRequest):
        return list(value.ids) if value.ids is not None else value.count
    if isinstance(value, RewardComponent):
        return {"name": value.name, "fn": value.fn, "weight": value.weight}
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    return value
