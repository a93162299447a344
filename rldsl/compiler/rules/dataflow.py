"""Dataflow rules: the graph's shape and its fields.

Rules that read the whole graph (reachability, fields, the missing pieces)
run only when it is the one written (``Pipeline.dataflow_known``); a cycle
or a bad edge among resolved names is reported whatever else is wrong."""

from __future__ import annotations

import networkx as nx

from rldsl.compiler.context import Context
from rldsl.compiler.diagnostics import ERROR, WARNING, Consequence, Diagnostic
from rldsl.compiler.ir import DATA, EPISODE_FIELDS, consumed_fields, produced_fields, token_weighting
from rldsl.compiler.rules.advice import free_name, frozen_edit, producer_help, unfrozen_reference
from rldsl.compiler.types import arg_span

# Which node kinds may feed which: dataset -> generate -> (reward|logprob)* -> train.
_ALLOWED_DATA_EDGES = {
    "dataset": {"generate"},
    "generate": {"reward", "logprob", "train"},
    "reward": {"reward", "logprob", "train"},
    "logprob": {"reward", "logprob", "train"},
    "train": set(),
}


def check_structure(ctx: Context) -> list[Diagnostic]:
    """RLP208: the pieces every RL pipeline needs."""
    pipe, out = ctx.pipe, []
    if pipe.declarations_known:  # otherwise a missing piece may be the block that was dropped
        out += _missing_pieces(ctx)
    trains = sorted(pipe.stages_of("train"), key=lambda s: s.name)  # which is "the second" must not hang on order
    for stage in trains[1:]:
        out.append(Diagnostic("RLP208", ERROR, f"a pipeline trains one model with one train stage: "
                              f"{ctx.label(stage.name)} is one of {len(trains)}", stage.name_span,
                              help="split the second trainer into its own `pipeline NAME { ... }`"))
    return out


def _missing_pieces(ctx: Context) -> list[Diagnostic]:
    pipe, out = ctx.pipe, []
    model = min(pipe.models, default="policy")
    needs = [("dataset", pipe.datasets, f"a `dataset {free_name(pipe, 'prompts')} {{ source = \"builtin:arith\" }}`"),
             ("generate stage", pipe.stages_of("generate"),
              f"a `stage generate {free_name(pipe, 'rollout')} {{ model = {model}  samples_per_prompt = 8 }}`"),
             ("reward stage", pipe.stages_of("reward"),
              f"a `stage reward {free_name(pipe, 'score')} {{ fn = \"rldsl.rewards:exact_match\" }}`"),
             ("train stage", pipe.stages_of("train"),
              f"a `stage train {free_name(pipe, 'actor')} {{ model = {model}  prompts_per_step = 8 }}`")]
    for what, present, how in needs:
        if not present:
            out.append(Diagnostic("RLP208", ERROR, f"pipeline `{pipe.name}` has no {what}", pipe.name_span,
                                  help=f"add {how} and put it in the flow"))
    train = ctx.train_stage()
    if train is not None and pipe.dataflow_known and pipe.stages_of("generate") and ctx.generator_for(train) is None:
        generator = min(s.name for s in pipe.stages_of("generate"))
        out.append(Diagnostic("RLP208", ERROR, f"no generate stage feeds {ctx.label(train.name)}", train.name_span,
                              help=f"put `{generator}` upstream of it: `flow ... -> {generator} -> ... -> "
                                   f"{train.name}`"))
    return out


def check_edges(ctx: Context) -> list[Diagnostic]:
    """RLP207: each flow edge joins kinds that can exchange data."""
    out = []
    for edge in ctx.pipe.edges:  # sync stages are weight edges, never data nodes
        for name, span in ((edge.src, edge.src_span), (edge.dst, edge.dst_span)):
            stage = ctx.pipe.stages.get(name)
            if stage is not None and stage.stage_kind == "sync":
                out.append(Diagnostic("RLP207", ERROR, f"sync stage {ctx.label(name)} cannot appear in a flow", span,
                                      help="a sync carries weights from `from` to `to`; leave it out of `flow`"))
    for src, dst, data in ctx.graph.edges(data=True):
        if data["kind"] != DATA:
            continue
        sk, dk = ctx.graph.nodes[src]["kind"], ctx.graph.nodes[dst]["kind"]
        if dk not in _ALLOWED_DATA_EDGES[sk]:
            hint = ("a train stage sends weights, not data: use `stage sync`" if sk == "train"
                    else f"a {sk} feeds " + (", ".join(sorted(_ALLOWED_DATA_EDGES[sk])) or "nothing"))
            where = f" in pipeline `{ctx.pipe.name}`" if ctx.program.multi else ""
            out.append(Diagnostic("RLP207", ERROR, f"`{src} -> {dst}`{where}: a {sk} cannot feed a {dk}",
                                  data["span"], help=hint))
    return out


def check_cycles(ctx: Context) -> list[Diagnostic]:
    """RLP201: data edges form a DAG. Weight edges are excluded by design."""
    out = []
    cycles = sorted({_rotated(c) for c in nx.simple_cycles(ctx.data)})  # a stable order whatever the file's
    for ring in cycles[:5]:
        path = " -> ".join(ring + (ring[0],))
        where = f" in pipeline `{ctx.pipe.name}`" if ctx.program.multi else ""
        closing = ctx.data.edges[ring[-1], ring[0]]
        out.append(Diagnostic("RLP201", ERROR, f"dataflow cycle{where}: {path}", closing["span"],
                              help="data must flow one way; weights go back through a `stage sync`"))
    return out


def _rotated(cycle: list[str]) -> tuple[str, ...]:
    start = cycle.index(min(cycle))
    return tuple(cycle[start:] + cycle[:start])


def check_reachability(ctx: Context) -> list[Diagnostic]:
    """RLP202 orphans (in no flow), RLP203 unreachable (no dataset feeds them)."""
    if not ctx.pipe.dataflow_known:
        return []
    out, view = [], ctx.data
    sources = sorted(n for n, d in view.nodes(data=True) if d["kind"] == "dataset")
    reached = set(sources).union(*(nx.descendants(view, s) for s in sources)) if sources else set()
    for name, stage in ctx.pipe.stages.items():
        if stage.stage_kind == "sync":
            continue
        if view.degree(name) == 0:
            out.append(Diagnostic("RLP202", WARNING, f"stage {ctx.label(name)} is in no flow", stage.name_span,
                                  help=f"add it to a `flow ... -> {name} -> ...` or remove it"))
        elif name not in reached:
            start = sources[0] if sources else free_name(ctx.pipe, "prompts")
            out.append(Diagnostic("RLP203", ERROR, f"stage {ctx.label(name)} is unreachable: no dataset feeds it",
                                  stage.name_span, help=f"start its flow at a dataset: `flow {start} -> ...`"))
    return out


def check_fields(ctx: Context) -> list[Diagnostic]:
    """RLP204: every consumed field is produced upstream."""
    if not ctx.pipe.dataflow_known:
        return []
    out = []
    for name, stage in ctx.pipe.stages.items():
        if name not in ctx.data or ctx.data.degree(name) == 0:
            continue  # orphans are reported once, by RLP202
        available, unknown = _upstream_fields(ctx, name)
        for field, why in _consumed(ctx, stage).items():
            if field not in available and field not in unknown:
                out.append(Diagnostic("RLP204", ERROR, f"stage {ctx.label(name)} consumes `{field}` but nothing "
                                      "upstream produces it", _field_span(ctx, stage, field), notes=(why,),
                                      help=producer_help(ctx, stage, field), **_reference_fix(ctx, stage, field)))
    return out


def _reference_fix(ctx: Context, stage, field: str) -> dict:
    """A policy scorer upstream that is meant as the reference: `frozen` fixes this finding, and its
    RLP205 (a policy scorer needs a sync, a frozen one does not) follows from the same slip."""
    scorer = unfrozen_reference(ctx, stage) if field == "ref_logprobs" else None
    if scorer is None or scorer.name not in ctx.upstream(stage.name):
        return {}
    return {"edit": frozen_edit(scorer), "explains": (Consequence("RLP205", scorer.name_span),)}


def _consumed(ctx: Context, stage) -> dict[str, str]:
    """What a stage reads, leaving out what depends on a setting that did not resolve."""
    lag = ctx.lag()
    need = consumed_fields(stage.stage_kind, stage, lag or 0)
    if stage.stage_kind == "train" and not stage.valid("loss"):
        need.pop("ref_logprobs", None)
    if lag is None:
        need.pop("behaviour_logprobs", None)
    return need


def _upstream_fields(ctx: Context, name: str) -> tuple[set[str], set[str]]:
    """(fields produced upstream, fields an upstream node may produce but whose settings did not resolve)."""
    available, unknown = set(), set()
    for up in ctx.upstream(name):
        node = ctx.graph.nodes[up]
        decl, kind = node["decl"], node["kind"]
        if kind == "generate" and not decl.valid("logprobs"):
            unknown.add("behaviour_logprobs")
        if kind == "generate" and not decl.valid("environment"):
            unknown.update(EPISODE_FIELDS)
        if kind == "logprob" and not decl.valid("frozen"):
            unknown.update(("ref_logprobs", "behaviour_logprobs"))
        available.update(produced_fields(kind, decl))
    return available, unknown


def _field_span(ctx: Context, stage, field: str):
    if field == "ref_logprobs" and stage.explicit("loss"):
        return arg_span(stage["loss"], "kl")
    weighting = token_weighting(stage.get("loss")) if stage.stage_kind == "train" and stage.valid("loss") else ""
    if field == "behaviour_logprobs" and weighting:
        return arg_span(stage["loss"], weighting.split(" = ")[0])
    if field == "behaviour_logprobs" and ctx.pipe.block("staleness").explicit("max_lag"):
        return ctx.pipe.block("staleness").span_of("max_lag")
    return stage.name_span


PASSES = (check_structure, check_edges, check_cycles, check_reachability, check_fields)
