"""Mixtures of experts on megatron (RLP515): expert parallelism whose
groups do not tile the stage's ranks, or that the model cannot take; a
mixture megatron here cannot convert (Qwen3-MoE it can): the memory
estimate counts `ep` and `etp`, `rldsl run` would refuse the stage."""

from __future__ import annotations

from pathlib import Path

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl
from rldsl.compiler.diagnostics import ERROR, Diagnostic
from rldsl.compiler.memory import hf_config, hf_shape
from rldsl.compiler.types import arg_span


def check_experts(ctx: Context) -> list[Diagnostic]:
    """RLP515, for every megatron stage whose engine resolved."""
    out = []
    for stage in ctx.pipe.stages.values():
        if stage.engine_name != "megatron" or stage.stage_kind not in ("train", "logprob"):
            continue
        finding = _ranks_finding(ctx, stage) or _model_finding(ctx, stage)
        if finding is not None:
            out.append(finding)
    return out


def _ranks_finding(ctx: Context, stage: Decl) -> Diagnostic | None:
    """Megatron's expert groups (etp x ep x pp ranks) tile the stage's ranks."""
    args = stage["engine"].args
    ep, tp, pp = args.get("ep", 1), args.get("tp", 1), args.get("pp", 1)
    etp = args.get("etp") or tp
    count = ctx.placement.gpu_counts.get((ctx.pipe.name, stage.name)) if ctx.placement is not None else None
    group = etp * ep * pp
    written = set(stage["engine"].arg_spans or {}) & {"ep", "etp"}
    if not written or not count or count % (tp * pp) or count % group == 0:  # tp x pp: RLP502's
        return None
    fits = [e for e in range(1, count + 1) if count % (etp * e * pp) == 0]
    key = "ep" if "ep" in written else "etp"
    return Diagnostic("RLP515", ERROR, f"{ctx.label(stage.name)} has {count} GPUs, not a multiple of its expert "
                      f"groups: etp x ep x pp = {etp} x {ep} x {pp} = {group}", arg_span(stage["engine"], key),
                      notes=("megatron splits each expert over `etp` ranks (default `tp`) and the experts over "
                             "`ep` groups of those, in every pipeline stage",),
                      help=f"ep values that fit: {', '.join(map(str, fits))}" if fits else
                           "lower etp or pp, or give the stage more GPUs")


def _model_finding(ctx: Context, stage: Decl) -> Diagnostic | None:
    """The model's type and experts: megatron converts only some; `ep` needs experts and must divide them."""
    model = ctx.pipe.model_of(stage)
    readable = model is not None and model.valid("source")
    shape = hf_shape(model, Path(ctx.program.filename).parent) if readable else None
    kind = (hf_config(model, Path(ctx.program.filename).parent) or {}).get("model_type") if readable else None
    if kind is not None and kind not in MEGATRON_MODEL_TYPES:
        return _not_yet(ctx, stage, f"model `{model.name}` is of type {kind!r} (megatron converts "
                                    f"{', '.join(MEGATRON_MODEL_TYPES)})")
    engine = stage["engine"]
    ep = engine.args.get("ep", 1)
    if shape is None:
        if ep > 1:  # the model's config is not readable: the run cannot train experts either way
            return _not_yet(ctx, stage, f"`ep = {ep}` asks for a mixture of experts")
        return None
    if not shape.experts:
        if ep > 1:
            return Diagnostic("RLP515", ERROR, f"{ctx.label(stage.name)}: `ep = {ep}` on model `{model.name}`, "
                              "which has no experts", arg_span(engine, "ep"),
                              help="remove `ep`: a dense model is split by tp, pp and the data-parallel ranks")
        return None
    if shape.experts % ep:
        fits = [e for e in range(1, shape.experts + 1) if shape.experts % e == 0 and e <= 64]
        return Diagnostic("RLP515", ERROR, f"{ctx.label(stage.name)}: {shape.experts} experts do not split over "
                          f"`ep = {ep}` groups", arg_span(engine, "ep"),
                          help=f"ep values that divide them: {', '.join(map(str, fits))}")
    if kind not in CONVERTED_MIXTURES:
        return _not_yet(ctx, stage, f"model `{model.name}` is a mixture of {shape.experts} experts of type "
                                    f"{kind!r} (megatron converts {', '.join(CONVERTED_MIXTURES)})")
    return None


# rldsl/runtime/engines/megatron/hf_weights.py's CONVERTED_MODEL_TYPES and its mixtures (a test keeps them equal)
MEGATRON_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
CONVERTED_MIXTURES = ("qwen3_moe",)


def _not_yet(ctx: Context, stage: Decl, why: str) -> Diagnostic:
    engine = stage["engine"]
    return Diagnostic("RLP515", ERROR, f"{ctx.label(stage.name)}: {why}, which the megatron engine does not "
                      "support yet", engine.name_span or stage.span_of("engine"),
                      notes=("the memory estimate (RLP506) counts `ep` and `etp`; `rldsl run` would refuse the "
                             "stage when megatron loads the model",),
                      help="use `engine = fsdp`, which trains the model as transformers builds it (its experts "
                           "sharded with every other weight)")


PASSES = (check_experts,)
