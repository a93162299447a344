"""Engine capability: the engine serves the stage's kind, with GPUs if it
needs them, with pipeline parallelism only where it supports it (RLP108)."""

from __future__ import annotations

from rldsl.compiler.context import Context
from rldsl.compiler.diagnostics import ERROR, Diagnostic
from rldsl.compiler.schema import ENGINES
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
            out.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` cannot run a {stage.stage_kind} stage "
                                  f"({ctx.label(stage.name)})", name_span,
                                  help="use " + " or ".join(f"`{u}`" for u in usable)))
        elif info.gpu_only and gpus_known and ctx.cluster["gpus_per_node"] == 0:
            out.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` needs GPUs and the cluster has none",
                                  name_span, help="use `torch` on a CPU cluster, or give the cluster GPUs"))
        elif engine.args.get("pp", 1) > 1 and stage.stage_kind not in info.pp_kinds:
            out.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` runs a {stage.stage_kind} stage without "
                                  f"pipeline parallelism, but {ctx.label(stage.name)} asks for pp = "
                                  f"{engine.args['pp']}", arg_span(engine, "pp"),
                                  help="split the model with `tp` instead, or leave pp = 1"))
    return out


PASSES = (check_engines,)
