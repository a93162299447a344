"""Rules over GPU sharing: colocation must sleep/offload (and wake with its
weights), partial overlaps must respect replica boundaries, pipelines
share GPUs only where they say so, on-policy on disjoint GPUs idles.

They read placed stages only: a stage left unplaced takes part in none."""

from __future__ import annotations

from itertools import combinations

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Program
from rldsl.compiler.diagnostics import ERROR, WARNING, Consequence, Diagnostic, Span
from rldsl.compiler.placement import Placement, StagePlacement
from rldsl.compiler.schema import ENGINES, can_sleep
from rldsl.compiler.types import arg_span


def check_sharing(program: Program, placement: Placement) -> list[Diagnostic]:
    """RLP504 and RLP505, for every pair of stages that share a GPU (across pipelines too)."""
    out, pairs = [], set()
    for residents in placement.residents().values():
        for a, b in combinations(residents, 2):
            pairs.add(tuple(sorted(((a.pipeline, a.stage), (b.pipeline, b.stage)))))
    sharing = {key for pair in pairs for key in pair}
    for key in sorted(sharing):
        out += _wake_findings(program, placement.stages[key])
    for key_a, key_b in sorted(pairs):
        a, b = placement.stages[key_a], placement.stages[key_b]
        out += _sleep_findings(program, a, b)
        if set(a.gpus) != set(b.gpus):
            out += _partial_overlap_findings(program, a, b)
    return out


def _decl(program: Program, sp: StagePlacement):
    return program.pipeline(sp.pipeline).stages[sp.stage]


def _sleep_findings(program: Program, a: StagePlacement, b: StagePlacement) -> list[Diagnostic]:
    out = []
    for this, other in ((a, b), (b, a)):
        engine = _decl(program, this)["engine"]
        if not can_sleep(engine):
            arg = ENGINES[engine.name].can_sleep_arg
            enable = f"`{engine.name}({arg} = true)`" if arg else "an engine that can release the GPU"
            span = arg_span(engine, arg) if arg else engine.span
            written = arg and arg in (engine.arg_spans or {})
            resident = " (a trainer may stay resident where the cluster's `gpu_memory` is declared and the " \
                "estimate of its GPUs fits)" if this.kind == "train" and this.pipeline == other.pipeline else ""
            out.append(Diagnostic("RLP504", ERROR, f"{program.label(this.pipeline, this.stage)} shares GPUs with "
                                  f"{program.label(other.pipeline, other.stage)} but its engine `{engine.name}` "
                                  "cannot sleep or offload", span,
                                  help=f"enable it, {enable}, or give the stages separate GPUs{resident}",
                                  edit=(span, f"{arg} = true") if written else None,
                                  subject=_pair(this, other)))
    return out


def _pair(a: StagePlacement, b: StagePlacement) -> str:
    """The subject of a finding about two stages sharing GPUs (RLP509 names the ones it explains)."""
    return " & ".join(sorted((f"{a.pipeline}/{a.stage}", f"{b.pipeline}/{b.stage}")))


def _wake_findings(program: Program, sp: StagePlacement) -> list[Diagnostic]:
    """vLLM's sleep level 2 discards the weights: only a stage that a sync refills may use it."""
    decl = _decl(program, sp)
    engine = decl["engine"]
    if engine.name not in ("vllm", "sglang") or engine.args.get("sleep") != 2:
        return []
    receives = _receives_sync(program.pipeline(sp.pipeline), sp.stage)
    if receives is not False:
        return []
    return [Diagnostic("RLP504", ERROR, f"{program.label(sp.pipeline, sp.stage)} sleeps at level 2, which discards "
                       "its weights, and no sync sends it new ones: it would wake without weights",
                       arg_span(engine, "sleep"),
                       help="use `sleep = 1` (or `true`): level 1 keeps the weights in host memory",
                       edit=(arg_span(engine, "sleep"), "sleep = 1"))]


def _receives_sync(pipe, stage: str) -> bool | None:
    syncs = pipe.stages_of("sync")
    if not pipe.declarations_known or not all(s.valid("to") for s in syncs):
        return None
    return any(ref.name == stage for s in syncs for ref in s["to"])


def _partial_overlap_findings(program: Program, a: StagePlacement, b: StagePlacement) -> list[Diagnostic]:
    return [d._replace(subject=_pair(a, b)) for d in _overlap_findings(program, a, b)]


def _overlap_findings(program: Program, a: StagePlacement, b: StagePlacement) -> list[Diagnostic]:
    big, small = (a, b) if len(a.gpus) >= len(b.gpus) else (b, a)
    span = _placement_span(program, small)
    big_name, small_name = program.label(big.pipeline, big.stage), program.label(small.pipeline, small.stage)
    if not set(small.gpus) <= set(big.gpus):
        return [Diagnostic("RLP505", ERROR, f"{small_name} (GPUs {_ids(small)}) and {big_name} (GPUs "
                           f"{_ids(big)}) overlap without one containing the other", span,
                           help="place the trainer on a subset of the generator's GPUs, or on disjoint GPUs")]
    if big.kind != "generate" or small.kind not in ("train", "logprob"):
        return [Diagnostic("RLP505", ERROR, f"{small_name} ({small.kind}) sits on part of {big_name}'s "
                           f"GPUs ({big.kind})", span,
                           help="a partial overlap puts a train or logprob stage on some of a generate stage's GPUs")]
    inside = set(small.gpus)
    out = []
    for rank in big.ranks:
        shared = inside & set(rank.gpus)
        if shared and shared != set(rank.gpus):
            out.append(Diagnostic("RLP505", ERROR, f"{small_name} cuts through replica {rank.index} of "
                                  f"{big_name} (GPUs {', '.join(map(str, rank.gpus))})", span,
                                  help="each generation replica must lie wholly inside or wholly outside the "
                                       "trainer's GPUs"))
    if not out and all(set(r.gpus) <= inside for r in big.ranks):
        out.append(Diagnostic("RLP505", ERROR, f"every replica of {big_name} overlaps {small_name}: "
                              "generation stops whenever training runs", span,
                              help=f"keep at least one replica outside, or write `colocate = {big.stage}`"
                              if big.pipeline == small.pipeline else "keep at least one replica outside"))
    return out


def _placement_span(program: Program, sp: StagePlacement):
    """Where the stage's GPUs were decided: its `gpus`, its `colocate`, or its pipeline's placement groups."""
    decl = _decl(program, sp)
    if sp.how == "group":
        return program.pipeline(sp.pipeline).block("placement").span_of("groups")
    return decl.span_of("colocate" if sp.how == "colocate" else "gpus")


def _ids(sp: StagePlacement) -> str:
    return ", ".join(map(str, sp.gpus))


def check_pipeline_sharing(program: Program, placement: Placement) -> list[Diagnostic]:
    """RLP509: pipelines share GPUs only when one of them names the other in `share`. It explains the
    RLP504 and RLP505 findings between their stages: without the overlap those stages would not meet.
    A warning: files written before `share` existed shared GPUs without it, and their pipelines take turns
    as if it were written (the plan is the same); `rldsl fmt --fix` writes it (old_meanings.py)."""
    shared: dict[tuple[str, str], dict[int, list[StagePlacement]]] = {}
    for gpu, residents in sorted(placement.residents().items()):
        for a, b in combinations(sorted(residents, key=lambda s: (s.pipeline, s.stage)), 2):
            if a.pipeline != b.pipeline:
                shared.setdefault((a.pipeline, b.pipeline), {}).setdefault(gpu, []).extend((a, b))
    out = []
    for (first, second), gpus in sorted(shared.items()):
        if _declared(program, first, second) is not False:
            continue
        gpu, residents = next(iter(gpus.items()))
        stage = next(s for s in residents if s.pipeline == second)
        names = ", ".join(sorted({program.label(s.pipeline, s.stage) for s in residents}))
        consequences = _pair_findings(program, gpus)
        out.append(Diagnostic(
            "RLP509", WARNING, f"pipelines `{first}` and `{second}` share GPU {gpu} ({names}) without declaring it: "
            "they take turns on it, as if declared",
            _placement_span(program, stage),
            notes=(f"GPUs shared by `{first}` and `{second}`: {', '.join(map(str, gpus))}",),
            help=_undeclared_help(program, first, second, any(d.code == "RLP504" for d in consequences)),
            edit=_share_edit(program, first, second), subject=f"{first} & {second}",
            explains=tuple(Consequence(d.code, d.span, d.subject) for d in consequences)))
    return out


def _pair_findings(program: Program, gpus: dict[int, list[StagePlacement]]) -> list[Diagnostic]:
    """The RLP504 and RLP505 findings between stages of the two pipelines on these GPUs."""
    stages = {(s.pipeline, s.stage): s for residents in gpus.values() for s in residents}
    pairs = {((a.pipeline, a.stage), (b.pipeline, b.stage))
             for residents in gpus.values() for a in residents for b in residents if a.pipeline < b.pipeline}
    out = []
    for key_a, key_b in sorted(pairs):
        a, b = stages[key_a], stages[key_b]
        out += _sleep_findings(program, a, b)
        if set(a.gpus) != set(b.gpus):
            out += _partial_overlap_findings(program, a, b)
    return out


def _undeclared_help(program: Program, first: str, second: str, sleepless: bool) -> str:
    """Placement groups split the whole cluster from GPU 0: a pipeline placed by groups cannot be given
    separate GPUs, only ids can."""
    block = program.pipeline(second).block("placement")
    where = "its `placement` block" if block.explicit("groups") or block.explicit("ratios") \
        else "a `placement { }` block"
    turns = f"add `share = [{first}]` to {where} in pipeline `{second}`"
    if sleepless:
        turns += " and let every engine on the shared GPUs sleep or offload (the RLP504 findings it explains)"
    grouped = [name for name in (first, second) if program.pipeline(name).block("placement").explicit("groups")]
    if not grouped:
        return f"if they are meant to take turns, {turns}; otherwise give them separate GPUs"
    which = f"pipeline `{grouped[0]}` splits" if len(grouped) == 1 else "both pipelines split"
    return (f"{which} the whole cluster into placement groups from GPU 0, so the two cannot have separate GPUs "
            f"while {'it keeps' if len(grouped) == 1 else 'they keep'} them: to take turns, {turns}; to run side by "
            f"side, place {' and '.join(f'`{g}`' for g in grouped)} with `gpus = [...]` ids on GPUs of "
            f"{'its' if len(grouped) == 1 else 'their'} own in place of `groups`")


def _share_edit(program: Program, first: str, second: str) -> tuple[Span, str]:
    """`first` added to the second pipeline's `share`, `share = [first]` inserted into its placement block, or
    the block added."""
    pipe = program.pipeline(second)
    block = pipe.block("placement")
    if block.explicit("share"):  # one more name in the list written
        names = [ref.name for ref in block.get("share") or ()] + [first]
        return block.span_of("share"), f"[{', '.join(names)}]"
    if block.span != pipe.span:  # the block is written: before its closing brace
        end = block.span
        return Span(end.end_line, end.end_col - 1, end.end_line, end.end_col - 1), f"share = [{first}] "
    end = pipe.span
    return Span(end.end_line, end.end_col - 1, end.end_line, end.end_col - 1), f"  placement {{ share = [{first}] }}\n"


def explain_memory(program: Program, diags: list[Diagnostic], memory: list) -> list[Diagnostic]:
    """RLP509 also explains the RLP506 of a GPU the two pipelines share when each pipeline's own stages
    there fit: the overflow is their sum. ``memory``: rldsl.compiler.memory.GpuMemory per GPU; an RLP506
    stands at its GPU's biggest stage, once per stage, so it is explained only when every overflow it
    stands for is."""
    capacity = program.cluster.get("gpu_memory") if program.cluster.valid("gpu_memory") else None
    if not capacity:
        return diags
    by_biggest: dict[str, list] = {}
    for mem in memory:
        if mem.used > capacity and mem.by_stage:
            by_biggest.setdefault(max(mem.by_stage, key=lambda s: s[1])[0], []).append(mem)
    out = []
    for d in diags:
        if d.code == "RLP509" and d.subject:
            pipes = set(d.subject.split(" & "))
            extra = tuple(Consequence("RLP506", _stage_decl(program, name).name_span)
                          for name, mems in sorted(by_biggest.items())
                          if all(_overflow_by_sum(mem, pipes, capacity) for mem in mems))
            d = d._replace(explains=d.explains + extra)
        out.append(d)
    return out


def allow_resident_trainers(program: Program, placement: Placement, diags: list[Diagnostic],
                            memory: list) -> list[Diagnostic]:
    """RLP504 spares a train stage that cannot offload when the memory check counts it on every GPU it
    shares, and they fit: the runtime leaves such a trainer on its GPUs (its `sleep` is a no-op) while
    the others take turns beside it, and the estimate adds its peak to theirs. Only within its own
    pipeline: other pipelines wait for a lease to be given back before using its GPUs. ``memory``:
    rldsl.compiler.memory.GpuMemory per GPU."""
    capacity = program.cluster.get("gpu_memory") if program.cluster.valid("gpu_memory") else None
    if not capacity:
        return diags
    by_gpu, residents = {m.gpu: m for m in memory}, placement.residents()
    spared = {_sleepless_span(program, sp) for sp in placement.stages.values()
              if sp.kind == "train" and sp.gpus and not can_sleep(_decl(program, sp)["engine"])
              and all(_counted_within(by_gpu.get(gpu), residents[gpu], sp.pipeline, capacity) for gpu in sp.gpus)}
    return [d for d in diags if not (d.code == "RLP504" and d.span in spared)]


def _sleepless_span(program: Program, sp: StagePlacement) -> Span:
    """Where RLP504 points for a stage that cannot sleep (its `_sleep_findings` span)."""
    engine = _decl(program, sp)["engine"]
    arg = ENGINES[engine.name].can_sleep_arg
    return arg_span(engine, arg) if arg else engine.span


def _counted_within(mem, residents: list[StagePlacement], pipeline: str, capacity: float) -> bool:
    """The GPU's estimate counts every stage on it, all of one pipeline, and fits."""
    return (mem is not None and len(mem.by_stage) == len(residents) and mem.used <= capacity
            and all(sp.pipeline == pipeline for sp in residents))


def _stage_decl(program: Program, label: str):
    pipeline, stage = label.split("/")
    return program.pipeline(pipeline).stages[stage]


def _overflow_by_sum(mem, pipes: set[str], capacity: float) -> bool:
    """The GPU holds stages of both pipelines and nothing else, and each pipeline's alone would fit."""
    held = {name.split("/")[0] for name, _ in mem.by_stage}
    alone = [sum(b for name, b in mem.by_stage if name.split("/")[0] == p) for p in pipes]
    return held == pipes and all(total <= capacity for total in alone)


def _declared(program: Program, a: str, b: str) -> bool | None:
    """Whether `a` or `b` names the other in `share`; None when a `share` did not resolve."""
    blocks = [program.pipeline(a).block("placement"), program.pipeline(b).block("placement")]
    if any(ref.name in (a, b) for block in blocks for ref in block.get("share") or ()):
        return True
    return None if not all(block.valid("share") for block in blocks) else False


def check_on_policy_disjoint(ctx: Context) -> list[Diagnostic]:
    """RLP401: max_lag = 0 with generation and training on disjoint GPUs."""
    train = ctx.train_stage()
    gen = train and ctx.generator_for(train)
    if ctx.lag() != 0 or gen is None or ctx.placement is None:
        return []
    gp, tp = ctx.placement.of(ctx.pipe.name, gen.name), ctx.placement.of(ctx.pipe.name, train.name)
    if not gp or not tp or not gp.gpus or not tp.gpus or set(gp.gpus) & set(tp.gpus):
        return []
    staleness = ctx.pipe.block("staleness")
    span = staleness.span_of("max_lag") if staleness.explicit("max_lag") else ctx.pipe.name_span
    return [Diagnostic("RLP401", WARNING, f"on-policy (max_lag = 0) with {ctx.label(gen.name)} and "
                       f"{ctx.label(train.name)} on disjoint GPUs: each side idles while the other works", span,
                       help="allow `max_lag = 1` in `staleness { }`, or colocate the stages",
                       edit=(span, "1") if staleness.explicit("max_lag") else None)]
