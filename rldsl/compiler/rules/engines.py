"""Engine capability: the engine serves the stage's kind, with GPUs if it
needs them, with pipeline parallelism only where it supports it, with a
logprob token budget only where rldsl chooses the forwards (RLP108);
weights that interrupt generation only where the engine resumes its rows
and behaviour logprobs are the generator's or the trainer's batch-start
ones (RLP110); `recompute` only
on a policy logprob stage (RLP111)."""

from __future__ import annotations

from rldsl.compiler.context import Context
from rldsl.compiler.diagnostics import ERROR, Diagnostic
from rldsl.compiler.schema import ENGINES, INTERRUPTING_ENGINES, TOKEN_BUDGET_LOGPROB_ENGINES
from rldsl.compiler.types import arg_span


def check_engines(ctx: Context) -> list[Diagnostic]:
    """RLP108, for every stage whose engine resolved."""
    out = []
    gpus_known = ctx.cluster.valid("gpus_per_node")
    for stage in ctx.pipe.stages.values():
        engine = stage.get("engine") if stage.valid("engine") else None
        if engine is None:
            continue
        info = ENGINES[engine.name]
        name_span = engine.name_span or stage.span_of("engine")
        if stage.stage_kind not in info.stage_kinds:
            usable = [n for n, e in ENGINES.items() if stage.stage_kind in e.stage_kinds]
            # the whole call is replaced: the old engine's arguments may mean nothing to the new one
            out.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` cannot run a {stage.stage_kind} stage "
                                  f"({ctx.label(stage.name)})", name_span,
                                  help="use " + " or ".join(f"`{u}`" for u in usable),
                                  edit=(stage.span_of("engine"), usable[0]) if usable else None))
        elif info.gpu_only and gpus_known and ctx.cluster["gpus_per_node"] == 0:
            out.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` needs GPUs and the cluster has none",
                                  name_span, help="use `torch` on a CPU cluster, or give the cluster GPUs"))
        elif engine.args.get("pp", 1) > 1 and stage.stage_kind not in info.pp_kinds:
            out.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` runs a {stage.stage_kind} stage without "
                                  f"pipeline parallelism, but {ctx.label(stage.name)} asks for pp = "
                                  f"{engine.args['pp']}", arg_span(engine, "pp"),
                                  help="split the model with `tp` instead, or leave pp = 1"))
        elif _budget_ignored(stage, engine.name):
            out.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` schedules its own logprob forwards, so "
                                  f"{ctx.label(stage.name)} cannot bound them with micro_batch_tokens = "
                                  f"{stage['micro_batch_tokens']}", stage.span_of("micro_batch_tokens"),
                                  help="leave micro_batch_tokens = 0, or score with " +
                                       " or ".join(f"`{e}`" for e in TOKEN_BUDGET_LOGPROB_ENGINES if e != "sim"),
                                  edit=(stage.span_of("micro_batch_tokens"), "0")))
    return out


def _budget_ignored(stage, engine: str) -> bool:
    """A logprob stage's token budget on an engine that would silently ignore it (vLLM, SGLang)."""
    return (stage.stage_kind == "logprob" and engine not in TOKEN_BUDGET_LOGPROB_ENGINES
            and stage.valid("micro_batch_tokens") and stage.get("micro_batch_tokens", 0) > 0)


def check_interrupt(ctx: Context) -> list[Diagnostic]:
    """RLP110, for every generate stage whose `update` and engine resolved."""
    out = []
    # a policy stage scoring at the generating version cannot follow a sample's versions; one scoring with
    # the trainer's batch-start weights (`recompute = batch_start`) does not need to
    policy_scorers = [s.name for s in ctx.pipe.stages.values()
                      if s.stage_kind == "logprob" and s.valid("frozen", "recompute") and not s.get("frozen")
                      and s.get("recompute") != "batch_start"]
    for stage in ctx.pipe.stages.values():
        if stage.stage_kind != "generate" or not stage.valid("update", "engine") or stage.get("update") != "interrupt":
            continue
        engine = stage.get("engine").name
        if engine not in INTERRUPTING_ENGINES:
            able = " or ".join(f"`{name}`" for name in INTERRUPTING_ENGINES)
            out.append(Diagnostic("RLP110", ERROR, f"engine `{engine}` cannot apply weights mid-generation "
                                  f"({ctx.label(stage.name)} sets update = interrupt)", stage.span_of("update"),
                                  help=f"use update = between_requests, or engine = {able}"))
        for scorer in policy_scorers:
            out.append(Diagnostic("RLP110", ERROR, f"{ctx.label(stage.name)} sets update = interrupt, but policy "
                                  f"logprob stage {ctx.label(scorer)} recomputes behaviour_logprobs at one version, "
                                  "not each token's", stage.span_of("update"),
                                  help=f"set `recompute = batch_start` on `{scorer}` (it then scores with the "
                                       "trainer's weights at the step's start), drop it (the generator records each "
                                       "token's logprob), or use update = between_requests"))
    return out


def check_recompute(ctx: Context) -> list[Diagnostic]:
    """RLP111: `recompute` chooses a policy stage's weights; a frozen reference has one set only."""
    out = []
    for stage in ctx.pipe.stages.values():
        if stage.stage_kind != "logprob" or not stage.explicit("recompute") or not stage.valid("frozen", "recompute"):
            continue
        if stage.get("frozen"):
            out.append(Diagnostic("RLP111", ERROR, f"{ctx.label(stage.name)} is `frozen` (a reference that never "
                                  f"receives weights), so `recompute = {stage.get('recompute')}` has no weights to "
                                  "choose between", stage.span_of("recompute"),
                                  help="drop `recompute`, or drop `frozen` to score the policy "
                                       "(behaviour_logprobs)"))
    return out


PASSES = (check_engines, check_interrupt, check_recompute)
