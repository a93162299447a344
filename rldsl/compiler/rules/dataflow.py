"""Dataflow rules: the graph's shape, its fields and its weight edges."""

from __future__ import annotations

import networkx as nx

from rldsl.compiler.context import Context
from rldsl.compiler.diagnostics import ERROR, WARNING, Diagnostic
from rldsl.compiler.ir import DATA, WEIGHTS, consumed_fields, produced_fields
from rldsl.compiler.schema import ENGINES

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
    needs = [("dataset", bool(pipe.datasets), "a `dataset NAME { source = ... }`"),
             ("generate stage", bool(pipe.stages_of("generate")), "a `stage generate NAME { ... }`"),
             ("reward stage", bool(pipe.stages_of("reward")), "a `stage reward NAME { fn = ... }`"),
             ("train stage", bool(pipe.stages_of("train")), "a `stage train NAME { ... }`")]
    for what, present, how in needs:
        if not present:
            out.append(Diagnostic("RLP208", ERROR, f"pipeline `{pipe.name}` has no {what}", pipe.name_span,
                                  help=f"add {how}"))
    train = ctx.train_stage()
    if train is not None and pipe.stages_of("generate") and ctx.generator_for(train) is None:
        out.append(Diagnostic("RLP208", ERROR, f"no generate stage feeds `{train.name}`", train.name_span,
                              help=f"put it at the end of a flow: `flow prompts -> rollout -> ... -> {train.name}`"))
    extra = pipe.stages_of("train")[1:]
    for stage in extra:
        out.append(Diagnostic("RLP208", ERROR, "a pipeline trains one model with one train stage", stage.name_span,
                              help="split the second trainer into its own `pipeline NAME { ... }`"))
    return out


def check_edges(ctx: Context) -> list[Diagnostic]:
    """RLP207: each flow edge joins kinds that can exchange data."""
    out = []
    for edge in ctx.pipe.edges:  # sync stages are weight edges, never data nodes
        for name, span in ((edge.src, edge.src_span), (edge.dst, edge.dst_span)):
            stage = ctx.pipe.stages.get(name)
            if stage is not None and stage.stage_kind == "sync":
                out.append(Diagnostic("RLP207", ERROR, f"sync stage `{name}` cannot appear in a flow", span,
                                      help="a sync carries weights from `from` to `to`; leave it out of `flow`"))
    for src, dst, data in ctx.graph.edges(data=True):
        if data["kind"] != DATA:
            continue
        sk, dk = ctx.graph.nodes[src]["kind"], ctx.graph.nodes[dst]["kind"]
        if dk not in _ALLOWED_DATA_EDGES[sk]:
            hint = ("a train stage sends weights, not data: use `stage sync`" if sk == "train"
                    else f"a {sk} feeds " + (", ".join(sorted(_ALLOWED_DATA_EDGES[sk])) or "nothing"))
            out.append(Diagnostic("RLP207", ERROR, f"`{src} -> {dst}`: a {sk} cannot feed a {dk}", data["span"],
                                  help=hint))
    return out


def check_cycles(ctx: Context) -> list[Diagnostic]:
    """RLP201: data edges form a DAG. Weight edges are excluded by design."""
    out, seen = [], set()
    for cycle in nx.simple_cycles(ctx.data):
        key = frozenset(cycle)
        if key in seen:
            continue
        seen.add(key)
        start = cycle.index(min(cycle))  # a stable rotation for the message
        ring = cycle[start:] + cycle[:start]
        path = " -> ".join(ring + [ring[0]])
        closing = ctx.data.edges[ring[-1], ring[0]]
        out.append(Diagnostic("RLP201", ERROR, f"dataflow cycle: {path}", closing["span"],
                              help="data must flow one way; weights go back through a `stage sync`"))
        if len(out) >= 5:
            break
    return out


def check_reachability(ctx: Context) -> list[Diagnostic]:
    """RLP202 orphans (in no flow), RLP203 unreachable (no dataset feeds them)."""
    out, view = [], ctx.data
    sources = [n for n, d in view.nodes(data=True) if d["kind"] == "dataset"]
    reached = set(sources).union(*(nx.descendants(view, s) for s in sources)) if sources else set()
    for name, stage in ctx.pipe.stages.items():
        if stage.stage_kind == "sync":
            continue
        if view.degree(name) == 0:
            out.append(Diagnostic("RLP202", WARNING, f"stage `{name}` is in no flow", stage.name_span,
                                  help=f"add it to a `flow ... -> {name} -> ...` or remove it"))
        elif name not in reached:
            out.append(Diagnostic("RLP203", ERROR, f"stage `{name}` is unreachable: no dataset feeds it",
                                  stage.name_span, help="start its flow at a dataset: `flow prompts -> ...`"))
    return out


def check_fields(ctx: Context) -> list[Diagnostic]:
    """RLP204: every consumed field is produced upstream."""
    out = []
    max_lag = ctx.pipe.block("staleness")["max_lag"]
    for name, stage in ctx.pipe.stages.items():
        if name not in ctx.data or ctx.data.degree(name) == 0:
            continue  # orphans are reported once, by RLP202
        available = {f for up in ctx.upstream(name)
                     for f in produced_fields(ctx.graph.nodes[up]["kind"], ctx.graph.nodes[up]["decl"])}
        for field, why in consumed_fields(stage.stage_kind, stage, max_lag).items():
            if field not in available:
                out.append(Diagnostic("RLP204", ERROR, f"stage `{name}` consumes `{field}` but nothing upstream "
                                      "produces it", _field_span(ctx, stage, field), notes=(why,),
                                      help=_producer_hint(field)))
    return out


def _field_span(ctx: Context, stage, field: str):
    if field == "ref_logprobs" and stage.explicit("loss"):
        return stage.span_of("loss")
    if field == "behaviour_logprobs" and ctx.pipe.block("staleness").explicit("max_lag"):
        return ctx.pipe.block("staleness").span_of("max_lag")
    return stage.name_span


def _producer_hint(field: str) -> str:
    return {
        "ref_logprobs": "add `stage logprob reference { model = policy  frozen  colocate = actor }` to the flow "
                        "before the trainer, or set kl = 0",
        "behaviour_logprobs": "keep `logprobs = true` on the generate stage, add a policy logprob stage, "
                              "or train on-policy with max_lag = 0",
        "reward": "add a `stage reward` to the flow before the trainer",
        "response_ids": "put a generate stage upstream",
        "answer": "start the flow at a dataset",
        "prompt": "start the flow at a dataset",
    }.get(field, "add a stage that produces it upstream")


def check_sync(ctx: Context) -> list[Diagnostic]:
    """RLP206: syncs go train -> generators of the same model.
    RLP205: every generator of a trained model receives one."""
    out, pipe = [], ctx.pipe
    for sync in pipe.stages_of("sync"):
        src = sync.get("from")
        source = pipe.stages.get(src.name) if src else None
        if source is not None and source.stage_kind != "train":
            out.append(Diagnostic("RLP206", ERROR, f"sync `{sync.name}` sends weights from `{source.name}`, "
                                  f"a {source.stage_kind} stage", src.span, help="`from` names a train stage"))
            continue
        for ref in sync.get("to") or ():
            target = pipe.stages.get(ref.name)
            if target is None:
                continue
            if not _receives_weights(target):
                out.append(Diagnostic("RLP206", ERROR, f"sync `{sync.name}` sends weights to `{target.name}`, "
                                      f"a {_describe(target)}", ref.span,
                                      help="`to` names generate stages (or policy logprob stages)"))
            elif source is not None and target.get("model") and source.get("model") \
                    and target["model"].name != source["model"].name:
                out.append(Diagnostic("RLP206", ERROR, f"sync `{sync.name}` sends `{source['model'].name}` weights "
                                      f"to `{target.name}`, which runs model `{target['model'].name}`", ref.span,
                                      help="a sync joins a trainer and generators of the same model"))
    out += _missing_syncs(ctx)
    return out


def _receives_weights(stage) -> bool:
    return stage.stage_kind == "generate" or (stage.stage_kind == "logprob" and not stage.get("frozen"))


def _describe(stage) -> str:
    if stage.stage_kind == "logprob" and stage.get("frozen"):
        return "frozen logprob stage"
    return f"{stage.stage_kind} stage"


def _missing_syncs(ctx: Context) -> list[Diagnostic]:
    out, pipe = [], ctx.pipe
    synced = {(u, v) for u, v, d in ctx.graph.edges(data=True) if d["kind"] == WEIGHTS}
    for train in pipe.stages_of("train"):
        model = train.get("model")
        for stage in pipe.stages.values():
            colocated = (stage.get("colocate") and stage["colocate"].name == train.name) \
                or _same_placement_group(pipe, stage.name, train.name)
            if (not _receives_weights(stage) or not model or not stage.get("model")
                    or stage["model"].name != model.name or (stage.stage_kind == "logprob" and colocated)):
                continue
            if (train.name, stage.name) not in synced:
                out.append(Diagnostic("RLP205", ERROR, f"`{stage.name}` runs model `{model.name}`, which `{train.name}` "
                                      "trains, but receives no weight sync", stage.name_span,
                                      help=f"add `stage sync weights {{ from = {train.name}  to = {stage.name} }}`"))
    return out


def _same_placement_group(pipe, a: str, b: str) -> bool:
    groups = pipe.block("placement").get("groups") or ()
    return any({a, b} <= {ref.name for ref in group} for group in groups)


def check_engines(ctx: Context) -> list[Diagnostic]:
    """RLP108: the engine serves this stage kind (with GPUs if it needs them,
    with pipeline parallelism only where it supports it)."""
    out = []
    for stage in ctx.pipe.stages.values():
        engine = stage.get("engine")
        if engine is None:
            continue
        info = ENGINES[engine.name]
        span = stage.span_of("engine")
        if stage.stage_kind not in info.stage_kinds:
            usable = [n for n, e in ENGINES.items() if stage.stage_kind in e.stage_kinds]
            out.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` cannot run a {stage.stage_kind} stage",
                                  span, help="use " + " or ".join(f"`{u}`" for u in usable)))
        elif info.gpu_only and ctx.cluster["gpus_per_node"] == 0:
            out.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` needs GPUs and the cluster has none",
                                  span, help="use `torch` on a CPU cluster"))
        elif engine.args.get("pp", 1) > 1 and stage.stage_kind not in info.pp_kinds:
            pp_span = (engine.arg_spans or {}).get("pp", span)
            out.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` runs a {stage.stage_kind} stage without "
                                  f"pipeline parallelism, but `{stage.name}` asks for pp = {engine.args['pp']}",
                                  pp_span, help="split the model with `tp` instead, or leave pp = 1"))
    return out


PASSES = (check_structure, check_edges, check_cycles, check_reachability, check_fields, check_sync, check_engines)
