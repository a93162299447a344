"""Placement: every rank of every stage on a node and GPU.

GPUs have global ids (node * gpus_per_node + local id). Pipelines are placed
in the order of their names and, within one, placement groups and explicit
ids first, then GPU counts packed first-fit in a fixed order (generate,
logprob, train stages, each by name; one node when it fits, so
tensor-parallel groups stay on a node), then `colocate` stages take their
target's GPUs. The file's order never matters. Pure: returns the placement
and the findings.

A stage whose GPUs cannot be decided (its own error, or an invalid input)
is left unplaced and recorded in ``failed``; once such a stage might have
taken GPUs, where later counts would land is unknown, so they stay unplaced
too, silently: rules never see a guessed placement.
"""


from dataclasses import dataclass, field
from typing import NamedTuple

from rldsl.compiler.decls import Decl, Pipeline, Program
from rldsl.compiler.diagnostics import ERROR, Diagnostic
from rldsl.compiler.placement_groups import plan_groups
from rldsl.compiler.schema import ENGINES
from rldsl.compiler.types import arg_span

GPU_KINDS = ("generate", "logprob", "train")


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
    failed: set[tuple[str, str]] = field(default_factory=set)  # GPU stages left unplaced
    gpu_counts: dict[tuple[str, str], int] = field(default_factory=dict)  # known even where the GPUs are not
    taken: set[int] = field(default_factory=set)
    packing_known: bool = True  # False once a stage that takes GPUs is unplaced

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

    def put(self, sp: StagePlacement) -> None:
        self.stages[(sp.pipeline, sp.stage)] = sp
        self.gpu_counts[(sp.pipeline, sp.stage)] = len(sp.gpus)
        self.taken.update(sp.gpus)

    def fail(self, pipeline: str, stage: str, takes_gpus: bool = False) -> None:
        self.stages.pop((pipeline, stage), None)
        self.failed.add((pipeline, stage))
        if takes_gpus:
            self.packing_known = False

    def settled(self, pipeline: str, stage: str) -> bool:
        return (pipeline, stage) in self.stages or (pipeline, stage) in self.failed


def place(program: Program) -> tuple[Placement | None, list[Diagnostic]]:
    """None when the cluster's size is unknown."""
    cluster = program.cluster
    if not cluster.valid("nodes", "gpus_per_node"):
        return None, []
    placement = Placement(cluster["nodes"], cluster["gpus_per_node"])
    diags: list[Diagnostic] = []
    for pipe in sorted(program.pipelines, key=lambda p: p.name):
        if not pipe.declarations_known:
            placement.packing_known = False  # a dropped or ambiguous stage might have taken GPUs
        _place_groups(program, pipe, placement, diags)
        _place_ids(program, pipe, placement, diags)
        _place_counts(program, pipe, placement, diags)
        _place_colocated(program, pipe, placement, diags)
        _place_cpu(pipe, placement)
    for sp in list(placement.stages.values()):
        _assign_ranks(sp, program.pipeline(sp.pipeline).stages[sp.stage], program, placement, diags)
    return placement, diags


def gpu_stages(pipe: Pipeline) -> list[Decl]:
    return [s for s in pipe.stages.values() if takes_gpus(s)]


def takes_gpus(stage: Decl) -> bool:
    """Generate, logprob and train stages, and a reward stage with a reward model
    (one whose model did not resolve too: it may have taken GPUs)."""
    if server_of(stage):
        return False
    return stage.stage_kind in GPU_KINDS or (stage.stage_kind == "reward" and has_reward_model(stage))


def reference_on_trainer(pipe: Pipeline, stage: Decl, placement: Placement | None) -> str | None:
    """The train stage whose policy, its LoRA adapters off, scores this frozen reference instead of a copy of
    the base: a frozen `torch` logprob stage colocated with a `torch` trainer of the same LoRA model, on GPUs
    where nothing would put that trainer to sleep (a generator, another pipeline). None otherwise."""
    if stage.stage_kind != "logprob" or not stage.valid("frozen", "colocate", "engine", "model") \
            or not stage.get("frozen") or stage.get("colocate") is None:
        return None
    trainer = pipe.stages.get(stage["colocate"].name)
    if trainer is None or trainer.stage_kind != "train" or not trainer.valid("engine", "model"):
        return None
    model = pipe.models.get(stage["model"].name)
    if stage["engine"].name != "torch" or trainer["engine"].name != "torch" or model is None \
            or trainer["model"].name != model.name or not model.valid("lora_rank") or not model.get("lora_rank"):
        return None
    placed = placement.of(pipe.name, trainer.name) if placement is not None else None
    if placed is None:
        return None
    residents = placement.residents()
    if any(other.pipeline != pipe.name or other.kind == "generate" for gpu in placed.gpus
           for other in residents.get(gpu, ())):
        return None
    return trainer.name


def server_of(stage: Decl) -> str | None:
    """The pipeline whose generator serves this generate stage (`served_by`), which then has no ranks of its
    own; None for every other stage."""
    ref = stage.get("served_by") if stage.stage_kind == "generate" and stage.valid("served_by") else None
    return ref.name if ref is not None else None


def has_reward_model(stage: Decl) -> bool:
    return bool(stage.get("model")) or not stage.valid("model")


def _parallelism(stage: Decl) -> tuple[int, int]:
    args = stage["engine"].args
    return args.get("tp", 1), args.get("pp", 1)


# ------------------------------------------------------------------ groups


def _place_groups(program: Program, pipe: Pipeline, placement: Placement, diags: list[Diagnostic]) -> None:
    plan, found = plan_groups(program, pipe, placement.total_gpus)
    diags += found
    if plan is None:  # which stages the groups hold is unknown
        for stage in gpu_stages(pipe):
            placement.fail(pipe.name, stage.name, takes_gpus=True)
        return
    for name in sorted(plan.members - set(plan.placed)):
        placement.fail(pipe.name, name, takes_gpus=not plan.slices)
    for name, (gpus, partners) in plan.placed.items():
        placement.put(StagePlacement(pipe.name, name, pipe.stages[name].stage_kind, gpus, colocated_with=partners,
                                     how="group"))
    placement.taken.update(g for gpus in plan.slices for g in gpus)


# ----------------------------------------------------------------- ids


def _place_ids(program: Program, pipe: Pipeline, placement: Placement, diags: list[Diagnostic]) -> None:
    for stage in gpu_stages(pipe):
        if placement.settled(pipe.name, stage.name):
            continue
        if not stage.valid("gpus"):
            placement.fail(pipe.name, stage.name, takes_gpus=True)  # ids or a count: unknown
            continue
        request = stage["gpus"]
        if request.ids is None:
            continue
        if stage.explicit("colocate") or not stage.valid("colocate"):
            continue  # RLP508 (both given) is reported with the colocations
        beyond = [g for g in request.ids if g >= placement.total_gpus]
        if beyond:
            diags.append(Diagnostic("RLP501", ERROR, f"GPU {beyond[0]} does not exist: the cluster has "
                                    f"{placement.total_gpus} GPUs ({_id_range(placement)})",
                                    stage.span_of("gpus"), help=f"use ids below {placement.total_gpus}, or grow "
                                                                "the cluster"))
            placement.fail(pipe.name, stage.name, takes_gpus=True)
            continue
        placement.put(StagePlacement(pipe.name, stage.name, stage.stage_kind, request.ids, how="ids"))


def _id_range(placement: Placement) -> str:
    return f"0..{placement.total_gpus - 1}" if placement.total_gpus else "none"


# --------------------------------------------------------------- counts


_KIND_ORDER = {kind: rank for rank, kind in enumerate((*GPU_KINDS, "reward"))}  # reward models last


def _place_counts(program: Program, pipe: Pipeline, placement: Placement, diags: list[Diagnostic]) -> None:
    pending = sorted((s for s in gpu_stages(pipe) if not placement.settled(pipe.name, s.name)
                      and s.valid("colocate") and not s.get("colocate") and s["gpus"].count > 0),
                     key=lambda s: (_KIND_ORDER[s.stage_kind], s.name))
    for stage in pending:
        want = stage["gpus"].count
        placement.gpu_counts[(pipe.name, stage.name)] = want
        if not placement.packing_known:
            placement.fail(pipe.name, stage.name)  # where it lands depends on a stage that is unplaced
            continue
        gpus = _first_fit(want, placement)
        if gpus is None:
            free = placement.total_gpus - len(placement.taken)
            asked = sum(s["gpus"].count for s in pending)
            diags.append(Diagnostic(
                "RLP501", ERROR, f"GPUs over-subscribed: {program.label(pipe.name, stage.name)} asks for {want} "
                f"GPU{'s' * (want != 1)}, {free} of {placement.total_gpus} are free", stage.span_of("gpus"),
                notes=(f"stages placed by count in `{pipe.name}` ask for {asked} GPUs in all",),
                help="colocate a stage (`colocate = other`), give fewer GPUs, or grow the cluster"))
            placement.fail(pipe.name, stage.name, takes_gpus=True)
            continue
        placement.put(StagePlacement(pipe.name, stage.name, stage.stage_kind, gpus))


def _first_fit(want: int, placement: Placement) -> tuple[int, ...] | None:
    per_node = placement.gpus_per_node
    free = [g for g in range(placement.total_gpus) if g not in placement.taken]
    if len(free) < want:
        return None
    free_by_node: dict[int, list[int]] = {}  # one pass: a scan per node made placement quadratic in the cluster
    for g in free:
        free_by_node.setdefault(g // per_node, []).append(g)
    if want <= per_node:  # keep it on one node when any node has room
        for node in range(placement.nodes):
            here = free_by_node.get(node, [])
            if len(here) >= want:
                return tuple(here[:want])
    whole_nodes = [n for n in range(placement.nodes) if len(free_by_node.get(n, ())) == per_node]
    if want % per_node == 0 and len(whole_nodes) * per_node >= want:
        return tuple(g for n in whole_nodes[: want // per_node] for g in range(n * per_node, (n + 1) * per_node))
    return tuple(free[:want])


# ------------------------------------------------------------ colocation


def _place_colocated(program: Program, pipe: Pipeline, placement: Placement, diags: list[Diagnostic]) -> None:
    pending = [s for s in gpu_stages(pipe) if not placement.settled(pipe.name, s.name)]
    for stage in [s for s in pending if not s.valid("colocate")]:
        placement.fail(pipe.name, stage.name)
        pending.remove(stage)
    pending = sorted((s for s in pending if s.get("colocate")), key=lambda s: s.name)
    progress = True
    while pending and progress:  # chains (a -> b -> c) resolve whatever the declaration order
        progress = False
        for stage in list(pending):
            if placement.settled(pipe.name, stage["colocate"].name) and not stage.explicit("gpus"):
                _colocate(program, stage, pipe, placement, diags)
                pending.remove(stage)
                progress = True
    for stage in pending:
        _colocate(program, stage, pipe, placement, diags)


def _colocate(program: Program, stage: Decl, pipe: Pipeline, placement: Placement, diags: list[Diagnostic]) -> None:
    ref = stage["colocate"]
    target = pipe.stages.get(ref.name)
    if target is not None and (pipe.name, target.name) in placement.failed and not stage.explicit("gpus"):
        placement.fail(pipe.name, stage.name)  # its target is unplaced: so is it, without a finding of its own
        return
    problem = _colocation_problem(program, stage, target, pipe, placement)
    if problem:
        both = "`gpus`" in problem
        diags.append(Diagnostic("RLP508", ERROR, problem, stage.span_of("gpus") if both else ref.span,
                                help=f"remove `gpus`: `{stage.name}` takes the GPUs of `{ref.name}`" if both
                                else "colocate with a GPU stage that is placed by `gpus` or by a chain of "
                                     "colocations that ends at one"))
        placement.fail(pipe.name, stage.name)
        return
    host = placement.stages[(pipe.name, target.name)]
    host.colocated_with = tuple(dict.fromkeys((*host.colocated_with, stage.name)))
    placement.put(StagePlacement(pipe.name, stage.name, stage.stage_kind, host.gpus, colocated_with=(target.name,),
                                 how="colocate"))


def _colocation_problem(program: Program, stage: Decl, target: Decl | None, pipe: Pipeline,
                        placement: Placement) -> str | None:
    name = program.label(pipe.name, stage.name)
    if target is None:
        return f"{name} colocates with an unknown stage"
    if target.name == stage.name:
        return f"{name} cannot colocate with itself"
    if stage.explicit("gpus"):
        return f"{name} gives both `gpus` and `colocate`"
    if not takes_gpus(target):
        return f"{program.label(pipe.name, target.name)} is a {target.stage_kind} stage and has no GPUs to share"
    if (pipe.name, target.name) not in placement.stages:
        return (f"{program.label(pipe.name, target.name)} has no GPUs of its own: its colocation chain loops or "
                "ends at an unplaced stage")
    return None


def _place_cpu(pipe: Pipeline, placement: Placement) -> None:
    for stage in pipe.stages.values():
        if placement.settled(pipe.name, stage.name) or stage.stage_kind == "sync" or server_of(stage):
            continue
        if stage.stage_kind == "reward" or (stage.get("gpus") and stage["gpus"].count == 0):
            placement.put(StagePlacement(pipe.name, stage.name, stage.stage_kind, (), how="cpu"))


# ----------------------------------------------------------------- ranks


def _assign_ranks(sp: StagePlacement, stage: Decl, program: Program, placement: Placement,
                  diags: list[Diagnostic]) -> None:
    name = program.label(sp.pipeline, stage.name)
    if sp.how == "cpu":
        if not stage.valid("workers", "engine"):
            placement.fail(sp.pipeline, sp.stage)
            return
        workers = stage.get("workers", 1) if stage.stage_kind == "reward" else 1
        sp.ranks = tuple(RankPlacement(i, ()) for i in range(workers))
        engine = stage.get("engine")
        if engine is not None and ENGINES[engine.name].gpu_only:
            diags.append(Diagnostic("RLP108", ERROR, f"engine `{engine.name}` needs GPUs; {name} has none",
                                    stage.span_of("gpus"), help="give the stage `gpus = 1` or more"))
        return
    if not stage.valid("engine"):
        placement.fail(sp.pipeline, sp.stage)  # its GPUs stay taken; its ranks are unknown
        return
    tp, pp = _parallelism(stage)
    replica = tp * pp
    n = len(sp.gpus)
    if n % replica:
        engine = stage["engine"]
        culprit = "tp" if n % tp else "pp"
        diags.append(Diagnostic("RLP502", ERROR, f"{name} has {n} GPU{'s' * (n != 1)}, not a multiple of "
                                f"tp x pp = {tp} x {pp} = {replica}", arg_span(engine, culprit),
                                help=f"give it {_multiples(n, replica)} GPUs, or change tp/pp"))
        placement.fail(sp.pipeline, sp.stage)
        return
    sp.tp, sp.pp, sp.dp = tp, pp, n // replica
    _check_tp_within_node(sp, stage, name, placement, diags)
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


def _check_tp_within_node(sp: StagePlacement, stage: Decl, name: str, placement: Placement,
                          diags: list[Diagnostic]) -> None:
    for start in range(0, len(sp.gpus), sp.tp):
        group = sp.gpus[start:start + sp.tp]
        nodes = sorted({placement.node_of(g) for g in group})
        if len(nodes) > 1:
            diags.append(Diagnostic("RLP503", ERROR, f"a tensor-parallel group of {name} spans nodes "
                                    f"{', '.join(map(str, nodes))} (GPUs {', '.join(map(str, group))})",
                                    arg_span(stage["engine"], "tp"),
                                    help=f"keep tp <= gpus_per_node ({placement.gpus_per_node}) and align the "
                                         "stage's GPUs to node boundaries"))
            return
