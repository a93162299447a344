"""A generate stage `served_by` another pipeline (RLP514): one generator
engine holds the base model once and serves every pipeline's LoRA adapters
per request, so the pipelines must share that base exactly, each declare
adapters, and leave the engine's settings to the serving stage; the serving
generator keeps its GPUs to itself (another stage there would put it to sleep
under pipelines that did not ask for it)."""

from __future__ import annotations

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl, Pipeline
from rldsl.compiler.diagnostics import ERROR, Diagnostic
from rldsl.compiler.placement import server_of
from rldsl.compiler.schema import SERVER_KEYS

SERVING_ENGINES = ("torch", "vllm")  # engines one generator of which serves several pipelines' adapters
_HELP = "docs/language.md#one-base-many-adapters"


def check_served_by(ctx: Context) -> list[Diagnostic]:
    """RLP514 on each generate stage `served_by` another pipeline."""
    out = []
    for stage in ctx.pipe.stages_of("generate"):
        owner = server_of(stage)
        if owner is None:
            continue
        for key in SERVER_KEYS:
            if stage.explicit(key):
                out.append(Diagnostic("RLP514", ERROR, f"{ctx.label(stage.name)} is served by `{owner}`'s generator "
                                      f"but sets `{key}`, which that generator decides", stage.span_of(key),
                                      notes=("one engine samples every pipeline it serves the same way; a served "
                                             "stage keeps `samples_per_prompt`, `concurrency`, `truncated` and "
                                             "`logprobs`",),
                                      help=f"remove `{key}` here (set it on `{owner}`'s generate stage)"))
        problem = _server_problem(ctx, stage, owner)
        if problem:
            out.append(Diagnostic("RLP514", ERROR, f"{ctx.label(stage.name)} cannot be `served_by = {owner}`: "
                                  f"{problem}", stage.span_of("served_by"),
                                  help=f"give this pipeline a generator of its own (remove `served_by`); {_HELP}"))
    return out


def _server_problem(ctx: Context, stage: Decl, owner_name: str) -> str | None:
    if owner_name == ctx.pipe.name:
        return "a pipeline does not serve itself"
    if len(ctx.pipe.stages_of("generate")) > 1:
        return f"pipeline `{ctx.pipe.name}` has other generate stages, and a served stage must be its only one"
    owner = ctx.program.pipeline(owner_name)
    servers = owner.stages_of("generate")
    if len(servers) != 1:
        return f"pipeline `{owner_name}` has {len(servers)} generate stages, and `served_by` needs exactly one"
    server = servers[0]
    if server_of(server):
        return f"`{owner_name}`'s generator is itself served by `{server_of(server)}`: name that pipeline"
    engine = server.engine_name
    if engine is not None and engine not in SERVING_ENGINES:
        return (f"`{owner_name}`'s generator uses engine `{engine}`; a generator serves several pipelines' "
                f"adapters on {', '.join(f'`{e}`' for e in SERVING_ENGINES)}")
    if server.valid("environment") and server.get("environment") is not None:
        return "a generator running multi-turn environments serves only its own pipeline"
    return _base_problem(ctx.pipe, stage, owner, server)


def _base_problem(pipe: Pipeline, stage: Decl, owner: Pipeline, server: Decl) -> str | None:
    """Why the two models do not share one base with adapters of their own, or None."""
    mine, theirs = pipe.model_of(stage), owner.model_of(server)
    if mine is None or theirs is None:
        return None  # an unresolved model: its own rule says so
    for pipeline, model in ((pipe, mine), (owner, theirs)):
        if not model.valid("lora_rank") or not model.get("lora_rank"):
            return (f"model `{model.name}` of pipeline `{pipeline.name}` has no `lora_rank`: pipelines share a "
                    "generator through their adapters, the base staying as loaded")
    if not mine.valid("source") or not theirs.valid("source"):
        return None
    if mine["source"] != theirs["source"]:
        return f"the models load different weights (`{mine['source']}` and `{theirs['source']}`)"
    if mine["source"].startswith("builtin:"):
        tasks = {_task(p) for p in (pipe, owner)}
        if len(tasks) > 1:
            return (f"`{mine['source']}` starts from a warm start per builtin task, and the pipelines train on "
                    f"{' and '.join(sorted(str(t) for t in tasks))}: their bases differ")
        seeds = {p.block("run")["seed"] for p in (pipe, owner)}
        if len(seeds) > 1:
            return (f"`{mine['source']}` is built from the run's `seed`, and the pipelines' seeds differ "
                    f"({sorted(seeds)})")
    return None


def _task(pipe: Pipeline) -> str | None:
    """The builtin task a builtin model warm-starts on: the first builtin dataset's (as the runtime loads it)."""
    sources = [d["source"] for d in pipe.datasets.values() if d.valid("source") and d["source"].startswith("builtin:")]
    return sources[0] if sources else None


def check_server_alone(ctx: Context) -> list[Diagnostic]:
    """RLP514: a generator serving other pipelines shares a GPU with another stage."""
    if ctx.placement is None:
        return []
    tenants = sorted(p.name for p in ctx.program.pipelines for s in p.stages_of("generate")
                     if server_of(s) == ctx.pipe.name)
    servers = [s for s in ctx.pipe.stages_of("generate") if not server_of(s)]
    if not tenants or len(servers) != 1:
        return []
    placed = ctx.placement.of(ctx.pipe.name, servers[0].name)
    if placed is None:
        return []
    residents = ctx.placement.residents()
    others = sorted({ctx.program.label(o.pipeline, o.stage) for gpu in placed.gpus for o in residents.get(gpu, ())
                     if o is not placed})
    if not others:
        return []
    return [Diagnostic("RLP514", ERROR, f"{ctx.label(servers[0].name)} serves {', '.join(tenants)} but shares its "
                       f"GPUs with {', '.join(others)}", servers[0].span_of("gpus"),
                       notes=("a generator that sleeps for another stage would stop every pipeline it serves",),
                       help="give the serving generator GPUs of its own")]


PASSES = (check_served_by,)
PLACED_PASSES = (check_server_alone,)
