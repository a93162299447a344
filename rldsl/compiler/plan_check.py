"""Re-checking a saved ExecutionPlan before it runs (`rldsl run --plan`, `--resume`).

A plan written by `rldsl plan --out` passed every rule, but it is a JSON file
anyone can edit. This pass re-runs, on the plan's own numbers, the checks a
hand edit can break: the batch arithmetic (RLP301, RLP302), the buffer's
deadlock proof and staleness window (RLP304-RLP306, the same arithmetic as
rules/batching.py), GPU ids within the cluster and every GPU used once unless
colocated (RLP501), ranks that match tp x pp x dp (RLP502), the collective
weight transport (RLP511), what the launcher refuses by the predicates
`check` asks of a file (rldsl/launch_rules.py: RLP106, RLP112, RLP116,
RLP117, RLP513), stages that run on another stage's actors naming one that
has them (RLP514 for `served_by`, RLP104 for `on_trainer`), and values of
the wrong type (RLP104). A plan has
no source text, so each finding names the plan field to look at.

Pure: no torch, no Ray, nothing from the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rldsl.compiler.diagnostics import ERROR
from rldsl.compiler.rules.batching import (
    buffer_findings,
    indivisible_message,
    is_minibatch,
    micro_batches_that_divide,
    minibatch_finding,
    splits_evenly,
)
from rldsl.launch_rules import plan_refusals
from rldsl.plan import ExecutionPlan, PipelinePlan

_BATCH_FIELDS = {"capacity": "buffer_capacity", "max_inflight": "max_inflight", "global_batch": "global_batch",
                 "micro_batch": "micro_batch"}
_POSITIVE = ("prompts_per_step", "samples_per_prompt", "global_batch", "micro_batch", "buffer_capacity",
             "max_inflight")
_FRACTION_SLACK = 1e-6


@dataclass(frozen=True)
class PlanFinding:
    code: str
    severity: str
    message: str
    field: str  # where in the plan: `pipelines[0].batch.buffer_capacity`
    notes: tuple[str, ...] = ()
    help: str | None = None

    @property
    def is_error(self) -> bool:
        return self.severity == ERROR


def check_plan(plan: ExecutionPlan) -> list[PlanFinding]:
    """Every finding of the plan, pipeline by pipeline, then the GPUs they share."""
    cluster = plan.cluster
    out = [] if _positive_int(cluster.nodes) else [_not_positive("cluster.nodes", cluster.nodes)]
    if not (_is_int(cluster.gpus_per_node) and cluster.gpus_per_node >= 0):
        out.append(PlanFinding("RLP104", ERROR, f"gpus_per_node is {cluster.gpus_per_node!r}, not a whole number "
                               ">= 0", "cluster.gpus_per_node"))
    if out:
        return out  # every GPU id is checked against these
    for index, pipe in enumerate(plan.pipelines):
        where = f"pipelines[{index}]"
        wrong_types = _wrong_types(pipe, where)
        out += wrong_types
        if wrong_types:
            continue  # the arithmetic below needs numbers
        out += _batch(pipe, where) + _ranks(pipe, where, plan) + _transport(pipe, where)
    if not any(f.code == "RLP104" for f in out):
        out += _shared_gpus(plan) + _launch_refusals(plan) + _borrowed_actors(plan)
    return out


def _borrowed_actors(plan: ExecutionPlan) -> list[PlanFinding]:
    """A served stage names another pipeline's serving generate stage; an on-trainer reference is a frozen
    logprob stage naming its own pipeline's trainer (the launcher would look for their actors there)."""
    servers = {f"{p.name}/{s.name}" for p in plan.pipelines for s in p.stages
               if s.kind == "generate" and not s.served_by}
    out = []
    for p_index, pipe in enumerate(plan.pipelines):
        for s_index, stage in enumerate(pipe.stages):
            field = f"pipelines[{p_index}].stages[{s_index}].settings"
            if stage.served_by and (stage.kind != "generate" or stage.served_by not in servers
                                    or stage.served_by.startswith(f"{pipe.name}/")):
                out.append(PlanFinding("RLP514", ERROR, f"`{stage.name}` is served by `{stage.served_by}`, which is "
                                       "no other pipeline's generate stage", f"{field}.served_by",
                                       help="name `pipeline/stage` of another pipeline's serving generate stage, "
                                            "or write the plan again with `rldsl plan --out`"))
            if stage.on_trainer and (stage.kind != "logprob" or not stage.settings.get("frozen")
                                     or stage.on_trainer != pipe.batch.train_stage):
                out.append(PlanFinding("RLP104", ERROR, f"`{stage.name}` is scored on `{stage.on_trainer}`'s ranks, "
                                       "but only a frozen logprob stage can be, on its own pipeline's trainer",
                                       f"{field}.on_trainer", help="remove `on_trainer`, or write the plan again "
                                                                   "with `rldsl plan --out`"))
    return out


def _launch_refusals(plan: ExecutionPlan) -> list[PlanFinding]:
    """What the launcher would refuse, by the predicates `check` asks of a file (rldsl/launch_rules.py)."""
    names = [p.name for p in plan.pipelines]
    return [PlanFinding(r.code, ERROR, r.message, f"pipelines[{names.index(r.pipeline)}]")
            for r in plan_refusals(plan)]


def render_plan_findings(findings: list[PlanFinding], plan_path: str) -> str:
    """Like `check`'s text, with the plan field in place of a source line."""
    lines = []
    for f in findings:
        lines += [f"{f.severity}[{f.code}]: {f.message}", f"  --> {plan_path}: {f.field}"]
        lines += [f"  = note: {note}" for note in f.notes]
        if f.help:
            lines.append(f"  = help: {f.help}")
        lines.append("")
    errors = sum(f.is_error for f in findings)
    lines.append(f"{errors} error{'s' * (errors != 1)}, {len(findings) - errors} warning"
                 f"{'s' * (len(findings) - errors != 1)} in the plan; fix the pipeline file and re-create the plan "
                 "with `rldsl plan FILE --out`, or correct the field")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- values


def _wrong_types(pipe: PipelinePlan, where: str) -> list[PlanFinding]:
    """Numbers where the runtime needs numbers: a hand edit can put anything in JSON."""
    out = [_not_positive(f"{where}.batch.{name}", getattr(pipe.batch, name))
           for name in _POSITIVE if not _positive_int(getattr(pipe.batch, name))]
    lag = pipe.staleness.max_lag
    if not (_is_int(lag) and lag >= 0):
        out.append(PlanFinding("RLP104", ERROR, f"max_lag is {lag!r}, not a whole number >= 0",
                               f"{where}.staleness.max_lag"))
    ahead = pipe.staleness.max_ahead
    if ahead is not None and not (isinstance(ahead, (int, float)) and not isinstance(ahead, bool)
                                  and _is_int(lag) and 0 <= ahead <= lag):
        out.append(PlanFinding("RLP104", ERROR, f"max_ahead is {ahead!r}, not a number from 0 to max_lag {lag!r}",
                               f"{where}.staleness.max_ahead"))
    if not any(s.name == pipe.batch.train_stage and s.kind == "train" for s in pipe.stages):
        out.append(PlanFinding("RLP104", ERROR, f"train_stage {pipe.batch.train_stage!r} names no train stage of "
                               f"pipeline `{pipe.name}`", f"{where}.batch.train_stage"))
    for s_index, stage in enumerate(pipe.stages):
        for name in ("tp", "pp", "dp"):
            if not _positive_int(getattr(stage, name)):
                out.append(_not_positive(f"{where}.stages[{s_index}].{name}", getattr(stage, name)))
        for r_index, rank in enumerate(stage.ranks):
            field = f"{where}.stages[{s_index}].ranks[{r_index}]"
            numbers = [rank.index, rank.node, rank.tp_rank, rank.pp_rank, rank.dp_rank, *rank.gpus]
            numbers += [v for remote in rank.remote for v in (remote.node, *remote.gpus)]
            if not all(_is_int(v) for v in numbers) or not isinstance(rank.gpu_fraction, (int, float)):
                out.append(PlanFinding("RLP104", ERROR, f"rank {r_index} of stage `{stage.name}` has a value that "
                                       "is not a whole number (index, node, gpus, tp/pp/dp rank) or a fraction "
                                       "(gpu_fraction)", field))
    return out


def _not_positive(field: str, value: Any) -> PlanFinding:
    return PlanFinding("RLP104", ERROR, f"{field.rsplit('.', 1)[-1]} is {value!r}, not a whole number >= 1", field)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _is_int(value) and value >= 1


# ----------------------------------------------------------------- batch


def _batch(pipe: PipelinePlan, where: str) -> list[PlanFinding]:
    """RLP301, RLP302 and RLP304-RLP306 on the plan's batch numbers."""
    batch = pipe.batch
    pps, spp, gb, mb = batch.prompts_per_step, batch.samples_per_prompt, batch.global_batch, batch.micro_batch
    out = []
    if not is_minibatch(pps, spp, gb):
        out.append(_from_batching(minibatch_finding(pps, spp, gb), where))
    dp = pipe.stage(batch.train_stage).dp
    if not splits_evenly(gb, mb, dp):
        options = micro_batches_that_divide(gb, dp)
        help_text = (f"micro_batch values that divide it: {', '.join(map(str, options[:8]))}" if options
                     else f"no micro_batch works: {gb} samples do not split over dp = {dp} ranks")
        out.append(PlanFinding("RLP302", ERROR, indivisible_message(gb, mb, dp), f"{where}.batch.micro_batch",
                               help=help_text))
    found = buffer_findings(pps, pipe.staleness.max_lag, batch.buffer_capacity, batch.max_inflight)
    return out + [_from_batching(f, where) for f in found]


def _from_batching(found, where: str) -> PlanFinding:
    return PlanFinding(found.code, found.severity, found.message, f"{where}.batch.{_BATCH_FIELDS[found.setting]}",
                       found.notes, found.help)


# ----------------------------------------------------------------- ranks


def _ranks(pipe: PipelinePlan, where: str, plan: ExecutionPlan) -> list[PlanFinding]:
    """GPU ids within the cluster (RLP501); ranks that tile tp x pp x dp (RLP502)."""
    out = []
    cluster = plan.cluster
    for s_index, stage in enumerate(pipe.stages):
        field = f"{where}.stages[{s_index}]"
        for r_index, rank in enumerate(stage.ranks):
            for node, gpu in rank.all_gpus():
                if not (0 <= node < cluster.nodes and 0 <= gpu < cluster.gpus_per_node):
                    out.append(PlanFinding(
                        "RLP501", ERROR, f"stage `{stage.name}` rank {rank.index} is on GPU {gpu} of node {node}, "
                        f"which does not exist: the cluster has {cluster.nodes} node(s) of {cluster.gpus_per_node} "
                        f"GPUs (0..{cluster.gpus_per_node - 1})", f"{field}.ranks[{r_index}].gpus",
                        help="use ids within the cluster, or grow `cluster`"))
        if any(rank.all_gpus() for rank in stage.ranks):
            out += _rank_layout(stage, field)
    return out


def _rank_layout(stage, field: str) -> list[PlanFinding]:
    def wrong(message: str, at: str) -> PlanFinding:
        return PlanFinding("RLP502", ERROR, f"stage `{stage.name}`: {message}", at,
                           notes=(f"tp x pp x dp = {stage.tp} x {stage.pp} x {stage.dp} = "
                                  f"{stage.tp * stage.pp * stage.dp} GPUs",))

    out = []
    engine_args = stage.engine.args if stage.engine else {}
    for name in ("tp", "pp"):
        if name in engine_args and engine_args[name] != getattr(stage, name):
            out.append(wrong(f"its engine says {name} = {engine_args[name]!r}, the stage {name} = "
                             f"{getattr(stage, name)}", f"{field}.{name}"))
    gpus = sum(len(rank.all_gpus()) for rank in stage.ranks)
    if gpus != stage.tp * stage.pp * stage.dp:
        out.append(wrong(f"its ranks hold {gpus} GPUs", f"{field}.ranks"))
    if [rank.index for rank in stage.ranks] != list(range(len(stage.ranks))):
        out.append(wrong("rank indices are not 0, 1, 2, ... in order", f"{field}.ranks"))
    coordinates = [(rank.tp_rank, rank.pp_rank, rank.dp_rank) for rank in stage.ranks]
    outside = [c for c in coordinates if not (0 <= c[0] < stage.tp and 0 <= c[1] < stage.pp and 0 <= c[2] < stage.dp)]
    if outside or len(set(coordinates)) != len(coordinates):
        out.append(wrong("its ranks' (tp_rank, pp_rank, dp_rank) are not distinct positions within tp x pp x dp"
                         + (f": {outside[0]} is outside" if outside else ""), f"{field}.ranks"))
    return out


def _shared_gpus(plan: ExecutionPlan) -> list[PlanFinding]:
    """RLP501: a GPU used by several ranks only when their stages are
    colocated, and their shares of it summing to at most one GPU."""
    users: dict[tuple[int, int], list[tuple[str, Any, Any, str]]] = {}
    for p_index, pipe in enumerate(plan.pipelines):
        many = len(plan.pipelines) > 1
        for s_index, stage in enumerate(pipe.stages):
            name = f"{pipe.name}/{stage.name}" if many else stage.name
            for r_index, rank in enumerate(stage.own_ranks):
                for place in rank.all_gpus():
                    users.setdefault(place, []).append(
                        (name, stage, rank, f"pipelines[{p_index}].stages[{s_index}].ranks[{r_index}]"))
    out = []
    for (node, gpu), ranks in sorted(users.items()):
        out += _one_gpu(node, gpu, ranks, many=len(plan.pipelines) > 1)
    return out


def _one_gpu(node: int, gpu: int, ranks: list, many: bool) -> list[PlanFinding]:
    for index, (name, stage, rank, field) in enumerate(ranks):
        for other_name, other, other_rank, _ in ranks[index + 1:]:
            if name == other_name:
                return [PlanFinding("RLP501", ERROR, f"GPU {gpu} of node {node} holds ranks {rank.index} and "
                                    f"{other_rank.index} of stage `{name}`", field,
                                    help="each rank of a stage needs GPUs of its own")]
            if not _colocated(stage, other_name, many) and not _colocated(other, name, many):
                return [PlanFinding("RLP501", ERROR, f"GPU {gpu} of node {node} is used by `{name}` and "
                                    f"`{other_name}`, which are not colocated", field,
                                    help="give each its own GPUs, or colocate them in the pipeline file")]
    share = sum(rank.gpu_fraction for _, _, rank, _ in ranks)
    if share > 1 + _FRACTION_SLACK:
        return [PlanFinding("RLP501", ERROR, f"GPU {gpu} of node {node} is over-subscribed: its ranks' "
                            f"gpu_fraction add up to {share:.3g}", ranks[0][3],
                            notes=("holders: " + ", ".join(f"`{n}` rank {r.index} ({r.gpu_fraction:.3g})"
                                                           for n, _, r, _ in ranks),),
                            help="re-create the plan with `rldsl plan FILE --out`")]
    return []


def _colocated(stage, other_name: str, many: bool) -> bool:
    """``other_name``: a stage name, or `pipeline/stage` when several pipelines run."""
    short = other_name.split("/", 1)[1] if many else other_name
    return other_name in stage.colocated_with or short in stage.colocated_with


# ------------------------------------------------------------- transport


def _transport(pipe: PipelinePlan, where: str) -> list[PlanFinding]:
    """RLP511: `transport = collective` only where every receiver can stand in a collective."""
    out = []
    for s_index, sync in enumerate(pipe.stages):
        if sync.kind != "sync" or sync.settings.get("transport") != "collective":
            continue
        blocker = _collective_blocker(pipe)
        if blocker:
            out.append(PlanFinding(
                "RLP511", ERROR, f"sync `{sync.name}` asks for `transport = collective`, but {blocker}",
                f"{where}.stages[{s_index}].settings.transport",
                notes=("a collective push streams each version to every receiver at once; a receiver must be a "
                       "generate stage on an engine that applies a stream between two batches, and awake",),
                help="use `transport = auto`, which goes rank to rank only where it can, or `object_store`"))
    return out


def _collective_blocker(pipe: PipelinePlan) -> str | None:
    missing = sorted(pipe.weight_receivers() - {s.name for s in pipe.stages})
    if missing:
        return f"its receiver `{missing[0]}` is no stage of the pipeline"
    return pipe.collective_blocker()
