"""Rules over GPU sharing: colocation must sleep/offload, partial overlaps
must respect replica boundaries, on-policy on disjoint GPUs idles."""

from __future__ import annotations

from itertools import combinations

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Program
from rldsl.compiler.diagnostics import ERROR, WARNING, Diagnostic
from rldsl.compiler.placement import Placement, StagePlacement
from rldsl.compiler.schema import can_sleep


def check_sharing(program: Program, placement: Placement) -> list[Diagnostic]:
    """RLP504 and RLP505, for every pair of stages that share a GPU (across pipelines too)."""
    out, pairs = [], set()
    for residents in placement.residents().values():
        for a, b in combinations(residents, 2):
            pairs.add(tuple(sorted(((a.pipeline, a.stage), (b.pipeline, b.stage)))))
    for key_a, key_b in sorted(pairs):
        a, b = placement.stages[key_a], placement.stages[key_b]
        out += _sleep_findings(program, a, b)
        if set(a.gpus) != set(b.gpus):
            out += _partial_overlap_findings(program, a, b)
    return out


def _decl(program: Program, sp: StagePlacement):
    return next(p for p in program.pipelines if p.name == sp.pipeline).stages[sp.stage]


def _sleep_findings(program: Program, a: StagePlacement, b: StagePlacement) -> list[Diagnostic]:
    out = []
    for this, other in ((a, b), (b, a)):
        decl = _decl(program, this)
        engine = decl["engine"]
        if not can_sleep(engine):
            where = f"`{other.stage}`" + (f" of pipeline `{other.pipeline}`" if other.pipeline != this.pipeline else "")
            out.append(Diagnostic("RLP504", ERROR, f"`{this.stage}` shares GPUs with {where} but its engine "
                                  f"`{engine.name}` cannot sleep or offload", decl.span_of("engine"),
                                  help=f"enable it (`{engine.name}(..., sleep = true)` / `offload = true`) "
                                       "or give the stages separate GPUs"))
    return out


def _partial_overlap_findings(program: Program, a: StagePlacement, b: StagePlacement) -> list[Diagnostic]:
    big, small = (a, b) if len(a.gpus) >= len(b.gpus) else (b, a)
    decl = _decl(program, small)
    span = decl.span_of("gpus")
    if not set(small.gpus) <= set(big.gpus):
        return [Diagnostic("RLP505", ERROR, f"`{small.stage}` (GPUs {_ids(small)}) and `{big.stage}` (GPUs "
                           f"{_ids(big)}) overlap without one containing the other", span,
                           help="place the trainer on a subset of the generator's GPUs, or on disjoint GPUs")]
    if big.kind != "generate" or small.kind not in ("train", "logprob"):
        return [Diagnostic("RLP505", ERROR, f"`{small.stage}` ({small.kind}) sits on part of `{big.stage}`'s "
                           f"GPUs ({big.kind})", span,
                           help="a partial overlap puts a train or logprob stage on some of a generate stage's GPUs")]
    inside = set(small.gpus)
    out = []
    for rank in big.ranks:
        shared = inside & set(rank.gpus)
        if shared and shared != set(rank.gpus):
            out.append(Diagnostic("RLP505", ERROR, f"`{small.stage}` cuts through replica {rank.index} of "
                                  f"`{big.stage}` (GPUs {', '.join(map(str, rank.gpus))})", span,
                                  help="each generation replica must lie wholly inside or wholly outside the "
                                       "trainer's GPUs"))
    if not out and all(set(r.gpus) <= inside for r in big.ranks):
        out.append(Diagnostic("RLP505", ERROR, f"every replica of `{big.stage}` overlaps `{small.stage}`: "
                              "generation stops whenever training runs", span,
                              help=f"keep at least one replica outside, or write `colocate = {big.stage}`"))
    return out


def _ids(sp: StagePlacement) -> str:
    return ", ".join(map(str, sp.gpus))


def check_on_policy_disjoint(ctx: Context) -> list[Diagnostic]:
    """RLP401: max_lag = 0 with generation and training on disjoint GPUs."""
    staleness = ctx.pipe.block("staleness")
    train = ctx.train_stage()
    gen = train and ctx.generator_for(train)
    if staleness["max_lag"] != 0 or gen is None or ctx.placement is None:
        return []
    gp, tp = ctx.placement.of(ctx.pipe.name, gen.name), ctx.placement.of(ctx.pipe.name, train.name)
    if not gp or not tp or not gp.gpus or not tp.gpus or set(gp.gpus) & set(tp.gpus):
        return []
    span = staleness.span_of("max_lag") if staleness.explicit("max_lag") else ctx.pipe.name_span
    return [Diagnostic("RLP401", WARNING, f"on-policy (max_lag = 0) with `{gen.name}` and `{train.name}` on "
                       "disjoint GPUs: each side idles while the other works", span,
                       help="allow `max_lag = 1` in `staleness { }`, or colocate the stages")]
