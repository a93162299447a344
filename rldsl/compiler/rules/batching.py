"""Batch-size and buffer rules, with the numbers in every message.

They read the trainer's and generator's sizes, and RLP302 the trainer's
data-parallel size; each runs when exactly those inputs resolved."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl
from rldsl.compiler.diagnostics import ERROR, WARNING, Diagnostic, Span
from rldsl.compiler.schema import GROUP_BASELINES, stage_engine_args
from rldsl.compiler.types import arg_span
from rldsl.plan import GROUP_SCALED, ahead_groups


def check_batch_sizes(ctx: Context) -> list[Diagnostic]:
    """RLP301 mini-batch shape, RLP302 divisibility, RLP303 group size of group estimators."""
    shape = ctx.step_shape()
    if shape is None:
        return []
    train, gen = shape
    pps, spp = train["prompts_per_step"], gen["samples_per_prompt"]
    gb, mb = train.get("global_batch", pps * spp), train.get("micro_batch", spp)
    of = f" of {ctx.label(train.name)}" if ctx.program.multi else ""
    out = []
    dp = data_parallel_size(ctx, train)
    if train.explicit("global_batch") and not is_minibatch(pps, spp, gb):
        out.append(_not_a_minibatch(ctx, train, gen, pps, spp, gb, of, mb, dp))
    if dp is not None and not splits_evenly(gb, mb, dp):
        out.append(_indivisible(ctx, train, spp, gb, mb, dp, of))
    estimator = train.get("advantage") if train.valid("advantage") else None
    if estimator in GROUP_BASELINES and spp < 2:
        out.append(_one_sample_group(ctx, train, gen, estimator, dp))
    return out


def _one_sample_group(ctx: Context, train: Decl, gen: Decl, estimator: str, dp: int | None) -> Diagnostic:
    """RLP303. The fix is more samples (a value the batch rules accept); reinforce_pp is a fix only with
    its own `normalize = batch`: `normalize = group` would zero it again (RLP314)."""
    spp = gen["samples_per_prompt"]
    where = f" in {ctx.label(gen.name)}" if ctx.program.multi else ""
    pps = train["prompts_per_step"]
    fixed = next((n for n in (4, 2, 8, 16) if _batch_fits(train, pps, n, dp)), None)
    group_scaled = train.valid("normalize") and train.explicit("normalize") and train["normalize"] in GROUP_SCALED
    switch = "advantage = reinforce_pp with normalize = batch" if group_scaled else "advantage = reinforce_pp"
    more = f"set samples_per_prompt = {fixed}" if fixed else "sample at least 2 responses per prompt"
    return Diagnostic("RLP303", ERROR, f"advantage = {estimator} with samples_per_prompt = {spp}{where}: every "
                      "advantage is zero", gen.span_of("samples_per_prompt"),
                      notes=(f"{estimator} compares each sample with the others of its prompt's group",),
                      help=f"{more} (a group needs 2 or more, 4-16 is typical), or use {switch}, which needs no "
                           "group",
                      edit=(gen.span_of("samples_per_prompt"), str(fixed)) if fixed else None)


def _batch_fits(train: Decl, pps: int, spp: int, dp: int | None) -> bool:
    """Whether RLP301 and RLP302 accept ``spp`` samples per prompt with the trainer's written sizes."""
    gb = train["global_batch"] if train.explicit("global_batch") else pps * spp
    mb = train["micro_batch"] if train.explicit("micro_batch") else spp
    return is_minibatch(pps, spp, gb) and (dp is None or splits_evenly(gb, mb, dp))


# ------------------------------------------------ the arithmetic, shared with plan_check.py


@dataclass(frozen=True)
class Finding:
    """A rule's verdict on plain numbers; ``setting`` is the one to change
    (the compiler points at its span, a plan check names its plan field)."""

    code: str
    severity: str
    message: str
    setting: str
    notes: tuple[str, ...] = ()
    help: str | None = None
    fix: str | None = None  # the value ``setting`` should hold, when one value fixes it


def is_minibatch(pps: int, spp: int, gb: int) -> bool:
    """RLP301: global_batch is whole prompt groups dividing the rollout batch."""
    return gb > 0 and (pps * spp) % gb == 0 and gb % spp == 0


def splits_evenly(gb: int, mb: int, dp: int) -> bool:
    """RLP302: every data-parallel rank runs whole microbatches."""
    return mb > 0 and dp > 0 and gb % (mb * dp) == 0


def micro_batches_that_divide(gb: int, dp: int) -> list[int]:
    return [m for m in range(1, gb + 1) if gb % (m * dp) == 0]


def global_batches_that_work(pps: int, spp: int, mb: int | None = None, dp: int | None = None) -> list[int]:
    """RLP301's values; with micro_batch and dp known, only those RLP302 accepts too."""
    fits = [g * spp for g in range(1, pps + 1) if pps % g == 0]
    return [g for g in fits if splits_evenly(g, mb, dp)] if mb and dp else fits


def nearest(values: list[int], target: int) -> int:
    return min(values, key=lambda v: (abs(v - target), v))


def minibatch_finding(pps: int, spp: int, gb: int, of: str = "", mb: int | None = None,
                      dp: int | None = None) -> Finding:
    rollout = pps * spp
    fits = global_batches_that_work(pps, spp, mb, dp)
    if fits:
        help_text = f"global_batch values that work: {_shown(fits, gb)}"
    else:  # every whole-group size is refused by RLP302: the micro_batch must change too
        help_text = (f"global_batch values of whole groups: {_shown(global_batches_that_work(pps, spp), gb)}, none "
                     f"of them a multiple of micro_batch x dp = {mb} x {dp}: lower micro_batch too")
    default_ok = not (mb and dp) or splits_evenly(rollout, mb, dp)
    return Finding("RLP301", ERROR, f"global_batch = {gb}{of} is not a whole number of prompt groups dividing the "
                   f"rollout batch: prompts_per_step x samples_per_prompt = {pps} x {spp} = {rollout}",
                   "global_batch",
                   notes=("each optimizer step trains global_batch samples of whole prompt groups, "
                          f"{rollout} // global_batch steps per rollout batch",),
                   help=help_text + ("; or leave it out (one optimizer step per rollout batch)" if default_ok else ""),
                   fix=str(nearest(fits, gb)) if fits else None)


def indivisible_message(gb: int, mb: int, dp: int, of: str = "") -> str:
    return f"global_batch = {gb}{of} is not divisible by micro_batch x dp = {mb} x {dp} = {mb * dp}"


def buffer_findings(pps: int, lag: int, cap: int, inflight: int, inflight_explicit: bool = True,
                    of: str = "") -> list[Finding]:
    """RLP304 deadlock proof, RLP305 in-flight limit, RLP306 staleness window, from the numbers alone."""
    window = pps * (lag + 1)
    out = []
    if cap < pps:
        out.append(Finding(
            "RLP304", ERROR, f"buffer capacity {cap}{of} < {pps} prompt groups per step: the rollout pump deadlocks",
            "capacity",
            notes=(f"a step finishes only after {pps} groups are trained, and trained groups stay stored until the "
                   "step's single clear",
                   f"after {cap} groups the buffer is full: the rollout pump waits for space, the train pump waits "
                   f"for group {cap + 1} of {pps}, and neither can move"),
            help=f"set capacity >= {pps} (>= {window} to fill the max_lag = {lag} window), or leave it out",
            fix=str(window)))
    elif cap < window:
        out.append(Finding(
            "RLP306", WARNING, f"buffer capacity {cap}{of} < prompts_per_step x (max_lag + 1) = {pps} x {lag + 1} = "
            f"{window}: generation cannot run the full {lag} step{'s' * (lag != 1)} ahead", "capacity",
            help=f"set capacity = {window} to overlap generation and training fully", fix=str(window)))
    if inflight < pps:
        out.append(Finding("RLP305", WARNING, f"max_inflight {inflight}{of} < {pps} prompt groups per step: each "
                           f"step's groups are generated in {-(-pps // max(inflight, 1))} waves", "max_inflight",
                           help=f"set max_inflight >= {pps}, or leave it out", fix=str(pps) if cap >= pps else None))
    elif inflight > cap and inflight_explicit:
        out.append(Finding("RLP305", WARNING, f"max_inflight {inflight}{of} > buffer capacity {cap}: the buffer "
                           "caps in-flight groups first, so the limit is never reached", "max_inflight",
                           help=f"set max_inflight <= {cap}", fix=str(cap)))
    return out


def _shown(values: list[int], around: int | None = None) -> str:
    """At most 8 values, those nearest ``around`` when there are more (the fix is never cut off)."""
    if len(values) <= 8:
        return ", ".join(map(str, values))
    target = values[0] if around is None else around
    kept = sorted(sorted(values, key=lambda v: (abs(v - target), v))[:8])
    return ("..., " if kept[0] != values[0] else "") + ", ".join(map(str, kept)) + \
        (", ..." if kept[-1] != values[-1] else "")


# ------------------------------------------------------------------ the rules


def _not_a_minibatch(ctx: Context, train: Decl, gen: Decl, pps: int, spp: int, gb: int, of: str, mb: int,
                     dp: int | None) -> Diagnostic:
    found = minibatch_finding(pps, spp, gb, of, mb, dp)
    span = train.span_of(found.setting)
    return Diagnostic(found.code, found.severity, found.message, span,
                      notes=(f"samples_per_prompt = {spp} comes from {ctx.label(gen.name)}", *found.notes),
                      help=found.help, edit=(span, found.fix) if found.fix else None)


def data_parallel_size(ctx: Context, train: Decl) -> int | None:
    """The trainer's GPUs / (tp x pp); None when its GPU count or engine is unknown (or they do not divide:
    RLP502's finding)."""
    placement = ctx.placement
    if placement is None:
        return None
    placed = placement.of(ctx.pipe.name, train.name)
    if placed is not None:
        return placed.dp if placed.gpus else 1  # a CPU trainer is one rank
    count = placement.gpu_counts.get((ctx.pipe.name, train.name))
    if count is None or not train.valid("engine"):
        return None
    shard = train["engine"].args.get("tp", 1) * train["engine"].args.get("pp", 1)
    return count // shard if count % shard == 0 and count else None


def _indivisible(ctx: Context, train: Decl, spp: int, gb: int, mb: int, dp: int, of: str) -> Diagnostic:
    options = micro_batches_that_divide(gb, dp)
    message = indivisible_message(gb, mb, dp, of)
    if options:
        span = train.span_of("micro_batch") if train.explicit("micro_batch") else train.name_span
        return Diagnostic("RLP302", ERROR, message, span, help=f"micro_batch values that divide it: "
                          f"{_shown(options, mb)}", edit=_set_edit(train, "micro_batch", nearest(options, mb)))
    span = train.span_of("gpus") if train.explicit("gpus") else train.name_span
    return Diagnostic("RLP302", ERROR, message, span,
                      notes=(f"no micro_batch works: {gb} samples do not split over dp = {dp} ranks",),
                      help=_dp_help(ctx, train, spp, gb, mb, dp))


def _dp_help(ctx: Context, train: Decl, spp: int, gb: int, mb: int, dp: int) -> str:
    """Fix the data-parallel size or the batch: the nearest GPU count and prompts_per_step with which the
    current micro_batch works."""
    args = train["engine"].args
    shard = args.get("tp", 1) * args.get("pp", 1)
    fits = [d for d in range(1, dp) if gb % (mb * d) == 0]
    parts = [f"put `{train.name}` on {fits[-1] * shard} GPUs (dp = {fits[-1]})"] if fits else []
    if not fits:  # no smaller dp works with this micro_batch: a smaller one with the micro_batch that fits it
        fits = [(d, m) for d in range(1, dp) for m in micro_batches_that_divide(gb, d)[-1:]]
        parts += [f"put `{train.name}` on {fits[-1][0] * shard} GPUs (dp = {fits[-1][0]}) with micro_batch = "
                  f"{fits[-1][1]}"] if fits else []
    pps = train["prompts_per_step"]
    if train.explicit("global_batch"):  # values RLP301 accepts too, never a bare multiple
        batches = [g for g in global_batches_that_work(pps, spp, mb, dp)]
        parts += [f"set global_batch = {nearest(batches, gb)}"] if batches else []
    else:
        better = next(p for p in range(pps + 1, pps + mb * dp + 1) if (p * spp) % (mb * dp) == 0)
        parts.append(f"set prompts_per_step = {better} ({better * spp} samples per step)")
    return " or ".join(parts) or f"change micro_batch and the GPU count together so micro_batch x dp divides {gb}"


def _set_edit(decl: Decl, key: str, value) -> tuple:
    """The edit that makes ``key`` hold ``value``: its written value replaced, or the key added after
    a key every such block writes (a train stage's `prompts_per_step`)."""
    if decl.explicit(key):
        return decl.span_of(key), str(value)
    anchor = decl.span_of("prompts_per_step")
    return Span(anchor.end_line, anchor.end_col, anchor.end_line, anchor.end_col), f"  {key} = {value}"


def check_shard_group(ctx: Context) -> list[Diagnostic]:
    """RLP510: the shard groups of an fsdp trainer, or of a sharded fsdp logprob stage, tile its ranks."""
    stages = [ctx.train_stage(), *ctx.pipe.stages_of("logprob")]
    return [d for stage in stages if stage is not None and stage.valid("engine") and stage["engine"].name == "fsdp"
            for d in _shard_group_findings(ctx, stage)]


def _shard_group_findings(ctx: Context, stage: Decl) -> list[Diagnostic]:
    shard, dp = stage_engine_args(stage["engine"], stage.stage_kind)["shard"], data_parallel_size(ctx, stage)
    if not shard or dp is None or dp % shard == 0:
        return []
    fits = [s for s in range(1, dp + 1) if dp % s == 0]
    span = arg_span(stage["engine"], "shard")
    return [Diagnostic("RLP510", ERROR, f"fsdp(shard = {shard}) on {dp} data-parallel rank{'s' * (dp != 1)}: the "
                       "shard groups do not divide them", span, edit=(span, f"shard = {nearest(fits, shard)}"),
                       notes=("hybrid sharding shards each tensor within a group of `shard` ranks and replicates "
                              "it across the groups",),
                       help=f"shard values that work: {', '.join(map(str, fits))} (0: shard over all ranks)")]


def check_buffer(ctx: Context) -> list[Diagnostic]:
    """RLP304 deadlock proof, RLP305 in-flight limit, RLP306 staleness window."""
    shape = ctx.buffer_shape()
    if shape is None:
        return []
    buffer = ctx.pipe.block("buffer")
    of = f" of pipeline `{ctx.pipe.name}`" if ctx.program.multi else ""
    return [Diagnostic(f.code, f.severity, f.message, buffer.span_of(f.setting), notes=f.notes, help=f.help,
                       edit=(buffer.span_of(f.setting), f.fix) if f.fix and buffer.explicit(f.setting) else None)
            for f in buffer_findings(*shape, inflight_explicit=buffer.explicit("max_inflight"), of=of)]


def check_ahead(ctx: Context) -> list[Diagnostic]:
    """RLP317: max_ahead within max_lag, and at least one whole group when max_lag lets samples go stale."""
    staleness, lag = ctx.pipe.block("staleness"), ctx.lag()
    if lag is None or not staleness.explicit("max_ahead") or not staleness.valid("max_ahead"):
        return []
    ahead, span = staleness["max_ahead"], staleness.span_of("max_ahead")
    if ahead > lag:
        needed = math.ceil(ahead)
        edit = (staleness.span_of("max_lag"), str(needed)) if staleness.explicit("max_lag") else \
            (Span(span.end_line, span.end_col, span.end_line, span.end_col), f"  max_lag = {needed}")
        return [Diagnostic("RLP317", ERROR, f"max_ahead = {ahead:g} > max_lag = {lag}: a group generated that far "
                           f"ahead trains up to {needed} version{'s' * (needed != 1)} after its weights", span,
                           notes=("max_ahead counts steps of prompts_per_step groups, as max_lag counts versions",),
                           help=f"set max_lag = {needed} (verl's staleness_threshold = {ahead:g} is max_lag = "
                                f"{needed} with max_ahead = {ahead:g}), or max_ahead <= {lag}", edit=edit)]
    train = ctx.train_stage()
    if lag == 0 or train is None or not train.valid("prompts_per_step"):
        return []
    pps = train["prompts_per_step"]
    if ahead_groups(lag, ahead, pps) >= 1:
        return []
    one_group = f"{math.ceil(1000 / pps) / 1000:g}"
    return [Diagnostic("RLP317", ERROR, f"max_ahead = {ahead:g} x prompts_per_step = {pps} is less than one "
                       f"group: nothing is generated ahead, so no sample trains off-policy although max_lag = {lag}",
                       span, notes=("groups generated ahead are whole groups, rounded down",),
                       help=f"set max_ahead = {one_group} (one group ahead) or more, or max_lag = 0 for an "
                            "on-policy pipeline", edit=(span, one_group))]


PASSES = (check_batch_sizes, check_shard_group, check_buffer, check_ahead)
