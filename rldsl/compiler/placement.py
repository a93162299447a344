"""Placement: every rank of every stage on a node and GPU.

GPUs have global ids (node * gpus_per_node + local id). Explicit ids and
placement groups are honoured first, then GPU counts are packed first-fit
(one node when it fits, so tensor-parallel groups stay on a node), then
`colocate` stages take their target's GPUs. Pure: returns the placement
and the findings.
"""


from dataclasses import dataclass, field
from typing import NamedTuple

from rldsl.compiler.decls import Decl, Program
from rldsl.compiler.diagnostics import ERROR, Diagnostic
from rldsl.compiler.schema import ENGINES


class RankPlacement(NamedTuple):
    index: int
    gpus: tuple[int, ...]  # global GPU ids; empty for CPU ranks
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0


@dataclass
class StagePlacement:
    pipeline: str
    stage: str
    kind: str
    gpus: tuple[int, ...]
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ranks: tuple[RankPlacement, ...] = ()
    colocated_with: tuple[str, ...] = ()
    how: str = "count"  # count | ids | group | colocate | cpu


@dataclass
class Placement:
    nodes: int
    gpus_per_node: int
    stages: dict[tuple[str, str], StagePlacement] = field(default_factory=dict)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def local(self, gpu: int) -> int:
        return gpu % self.gpus_per_node

    def of(self, pipeline: str, stage: str) -> StagePlacement | None:
        return self.stages.get((pipeline, stage))

    def residents(self) -> dict[int, list[StagePlacement]]:
        """GPU id -> the stages on it."""
        out: dict[int, list[StagePlacement]] = {g: [] for g in range(self.total_gpus)}
        for sp in self.stages.values():
            for g in sp.gpus:
                out.setdefault(g, []).append(sp)
        return out


def place(program: Program) -> tuple[Placement, list[Diagnostic]]:
    cluster = program.cluster
    placement = Placement(cluster["nodes"], cluster["gpus_per_node"])
    diags: list[Diagnostic] = []
    taken: set[int] = set()
    for pipe in program.pipelines:
        _place_groups(pipe, placement, taken, diags)
        _place_ids(pipe, placement, taken, diags)
        _place_counts(pipe, placement, taken, diags)
        _place_colocated(pipe, placement, diags)
        _place_cpu(pipe, placement)
    for sp in placement.stages.values():
        _assign_ranks(sp, _decl(program, sp), placement, diags)
    return placement, diags


def _decl(program: Program, sp: StagePlacement) -> Decl:
    return next(p for p in program.pipelines if p.name == sp.pipeline).stages[sp.stage]


def _gpu_stages(pipe) -> list[Decl]:
    return [s for s in pipe.stages.values() if s.stage_kind in ("generate", "logprob", "train")]


def _parallelism(stage: Decl) -> tuple[int, int]:
    args = stage["engine"].args
    return args.get("tp", 1), args.get("pp", 1)


# ------------------------------------------------------------------ groups


def _place_groups(pipe, placement: Placement, taken: set[int], diags: list[Diagnostic]) -> None:
    block = pipe.block("placement")
    groups, ratios = block.get("groups"), block.get("ratios")
    if groups is None and ratios is None:
        return
    span = block.span_of("ratios") if ratios is not None else block.span_of("groups")
    if groups is None or ratios is None or len(groups) != len(ratios):
        diags.append(Diagnostic("RLP507", ERROR, "placement needs one ratio per group", span,
                                help="write `groups = [[a, b], c]  ratios = [50%, 50%]`"))
        return
    if abs(sum(ratios) - 1.0) > 1e-6:
        diags.append(Diagnostic("RLP507", ERROR, f"placement ratios sum to {sum(ratios):.0%}, not 100%", span))
        return
    seen: set[str] = set()
    cursor, total = 0, placement.total_gpus
    for group, ratio in zip(groups, ratios):
        share = ratio * total
        if abs(share - round(share)) > 1e-6 or round(share) == 0:
            diags.append(Diagnostic("RLP507", ERROR, f"{ratio:.0%} of {total} GPUs is {share:g} GPUs, not a "
                                    "whole number", span, help="pick ratios that split the GPUs evenly"))
            return
        gpus = tuple(range(cursor, cursor + round(share)))
        cursor += round(share)
        names = [ref.name for ref in group]
        for ref in group:
            stage = pipe.stages.get(ref.name)
            if stage is None:
                continue
            if ref.name in seen:
                diags.append(Diagnostic("RLP507", ERROR, f"stage `{ref.name}` is in two placement groups", ref.span))
                continue
            seen.add(ref.name)
            if stage.explicit("gpus") or stage.explicit("colocate"):
                key = "gpus" if stage.explicit("gpus") else "colocate"
                diags.append(Diagnostic("RLP507", ERROR, f"stage `{ref.name}` is in a placement group and also sets "
                                        f"`{key}`", stage.span_of(key), help=f"remove `{key}`: the group decides"))
                continue
            if stage.stage_kind not in ("generate", "logprob", "train"):
                diags.append(Diagnostic("RLP507", ERROR, f"stage `{ref.name}` is a {stage.stage_kind} stage and "
                                        "uses no GPUs", ref.span, help="placement groups hold GPU stages"))
                continue
            others = tuple(n for n in names if n != ref.name)
            placement.stages[(pipe.name, ref.name)] = StagePlacement(
                pipe.name, ref.name, stage.stage_kind, gpus, colocated_with=others, how="group")
        taken.update(gpus)


# ----------------------------------------------------------------- ids


def _place_ids(pipe, placement: Placement, taken: set[int], diags: list[Diagnostic]) -> None:
    for stage in _gpu_stages(pipe):
        request = stage["gpus"]
        if (pipe.name, stage.name) in placement.stages or request.ids is None:
            continue
        beyond = [g for g in request.ids if g >= placement.total_gpus]
        if beyond:
            diags.append(Diagnostic("RLP501", ERROR, f"GPU {beyond[0]} does not exist: the cluster has "
                                    f"{placement.total_gpus} GPUs (0..{placement.total_gpus - 1})",
                                    stage.span_of("gpus"), help="use ids below the cluster's GPU count"))
            continue
        placement.stages[(pipe.name, stage.name)] = StagePlacement(pipe.name, stage.name, stage.stage_kind,
                                                                   request.ids, how="ids")
        taken.update(request.ids)


# --------------------------------------------------------------- counts


def _place_counts(pipe, placement: Placement, taken: set[int], diags: list[Diagnostic]) -> None:
    pending = [s for s in _gpu_stages(pipe) if (pipe.name, s.name) not in placement.stages
               and not s.get("colocate") and s["gpus"].ids is None and s["gpus"].count > 0]
    for stage in pending:
        want = stage["gpus"].count
        gpus = _first_fit(want, placement, taken)
        if gpus is None:
            free = placement.total_gpus - len(taken)
            asked = sum(s["gpus"].count for s in pending)
            diags.append(Diagnostic(
                "RLP501", ERROR, f"GPUs over-subscribed: `{stage.name}` asks for {want} GPU{'s' * (want != 1)}, "
                f"{free} of {placement.total_gpus} are free", stage.span_of("gpus"),
                notes=(f"stages placed by count in `{pipe.name}` ask for {asked} GPUs in all",),
                help="colocate a stage (`colocate = other`), give fewer GPUs, or grow the cluster"))
            continue
        taken.update(gpus)
        placement.stages[(pipe.name, stage.name)] = StagePlacement(pipe.name, stage.name, stage.stage_kind, gpus)


def _first_fit(want: int, placement: Placement, taken: set[int]) -> tuple[int, ...] | None:
    per_node = placement.gpus_per_node
    free = [g for g in range(placement.total_gpus) if g not in taken]
    if len(free) < want:
        return None
    if want <= per_node:  # keep it on one node when any node has room
        for node in range(placement.nodes):
            here = [g for g in free if g // per_node == node]
            if len(here) >= want:
                return tuple(here[:want])
    whole_nodes = [n for n in range(placement.nodes) if all(g in free for g in range(n * per_node, (n + 1) * per_node))]
    if want % per_node == 0 and len(whole_nodes) * per_node >= want:
        return tuple(g for n in whole_nodes[: want // per_node] for g in range(n * per_node, (n + 1) * per_node))
    return tuple(free[:want])


# ------------------------------------------------------------ colocation


def _place_colocated(pipe, placement: Placement, diags: list[Diagnostic]) -> None:
    pending = [s for s in _gpu_stages(pipe) if s.get("colocate") and (pipe.name, s.name) not in placement.stages]
    progress = True
    while pending and progress:  # chains (a -> b -> c) resolve whatever the declaration order
        progress = False
        for stage in list(pending):
            if (pipe.name, stage["colocate"].name) in placement.stages and not stage.explicit("gpus"):
                _colocate(stage, pipe, placement, diags)
                pending.remove(stage)
                progress = True
    for stage in pending:
        _colocate(stage, pipe, placement, diags)


def _colocate(stage: Decl, pipe, placement: Placement, diags: list[Diagnostic]) -> None:
    ref = stage["colocate"]
    target = pipe.stages.get(ref.name)
    problem = _colocation_problem(stage, target, pipe, placement)
    if problem:
        diags.append(Diagnostic("RLP508", ERROR, problem, ref.span if "`gpus`" not in problem
                                else stage.span_of("gpus"), help="colocate with a GPU stage that is placed "
                                "by `gpus` or by a chain of colocations that ends at one"))
        return
    host = placement.stages[(pipe.name, target.name)]
    host.colocated_with = tuple(dict.fromkeys((*host.colocated_with, stage.name)))
    placement.stages[(pipe.name, stage.name)] = StagePlacement(
        pipe.name, stage.name, stage.stage_kind, host.gpus, colocated_with=(target.name,), how="colocate")


def _colocation_problem(stage: Decl, target: Decl | None, pipe, placement: Placement) -> str | None:
    if target is None:
        return f"`{stage.name}` colocates with an unknown stage"
    if target.name == stage.name:
        return f"`{stage.name}` cannot colocate with itself"
    if stage.explicit("gpus"):
        return f"`{stage.name}` gives both `gpus` and `colocate`"
    if target.stage_kind not in ("generate", "logprob", "train"):
        return f"`{target.name}` is a {target.stage_kind} stage and has no GPUs to share"
    if (pipe.name, target.name) not in placement.stages:
        return f"`{target.name}` has no GPUs of its own: its colocation chain loops or ends at an unplaced stage"
    return None


def _place_cpu(pipe, placement: Placement) -> None:
    for stage in pipe.stages.values():
        if (pipe.name, stage.name) in placement.stages or stage.stage_kind == "sync":
            continue
        if stage.stage_kind == "reward" or (stage.get("gpus") and stage["gpus"].count == 0):
            placement.stages[(pipe.name, stage.name)] = StagePlacement(pipe.name, stage.name, stage.stage_kind, (),
                                                                       how="cpu")


# ----------------------------------------------------------------- ranks


def _assign_ranks(sp: StagePlacement, stage: Decl, placement: Placement, diags: list[Diagnostic]) -> None:
    if sp.how == "cpu":
        workers = stage.get("workers", 1) if stage.stage_kind == "reward" else 1
        sp.ranks = tuple(RankPlacement(i, ()) for i in range(workers))
        engine = stage.get("engine")
        if engine is not None and ENGINES[engine.name].gpu_only:
            diags.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` needs GPUs; `{stage.name}` has none",
                                    stage.span_of("gpus"), help="give the stage `gpus = 1` or more"))
        return
    tp, pp = _parallelism(stage)
    replica = tp * pp
    n = len(sp.gpus)
    if n % replica:
        diags.append(Diagnostic("RLP502", ERROR, f"`{stage.name}` has {n} GPU{'s' * (n != 1)}, not a multiple of "
                                f"tp x pp = {tp} x {pp} = {replica}", stage.span_of("engine"),
                                help=f"give it {_multiples(n, replica)} GPUs, or change tp/pp"))
        return
    sp.tp, sp.pp, sp.dp = tp, pp, n // replica
    _check_tp_within_node(sp, stage, placement, diags)
    if stage.stage_kind in ENGINES[stage["engine"].name].replica_actor_kinds:  # one actor drives a whole replica
        sp.ranks = tuple(RankPlacement(r, sp.gpus[r * replica:(r + 1) * replica], dp_rank=r) for r in range(sp.dp))
        return
    # Megatron order: tp fastest, then dp, pp slowest.
    sp.ranks = tuple(
        RankPlacement(r, (sp.gpus[r],), tp_rank=r % tp, dp_rank=(r // tp) % sp.dp, pp_rank=r // (tp * sp.dp))
        for r in range(n))


def _multiples(n: int, replica: int) -> str:
    options = sorted({m for m in (n - n % replica, n - n % replica + replica) if m > 0})
    return " or ".join(map(str, options))


def _check_tp_within_node(sp: StagePlacement, stage: Decl, placement: Placement, diags: list[Diagnostic]) -> None:
    for start in range(0, len(sp.gpus), sp.tp):
        group = sp.gpus[start:start + sp.tp]
        nodes = sorted({placement.node_of(g) for g in group})
        if len(nodes) > 1:
            diags.append(Diagnostic("RLP503", ERROR, f"a tensor-parallel group of `{stage.name}` spans nodes "
                                    f"{', '.join(map(str, nodes))} (GPUs {', '.join(map(str, group))})",
                                    stage.span_of("engine"),
                                    help=f"keep tp <= gpus_per_node ({placement.gpus_per_node}) and align the "
                                         "stage's GPUs to node boundaries"))
            return
