"""Batch-size and buffer rules, with the numbers in every message."""

from __future__ import annotations

from rldsl.compiler.context import Context
from rldsl.compiler.diagnostics import ERROR, WARNING, Diagnostic


def check_batch_sizes(ctx: Context) -> list[Diagnostic]:
    """RLP301 product, RLP302 divisibility, RLP303 GRPO group size."""
    sizing = ctx.sizing()
    if sizing is None:
        return []
    train = ctx.pipe.stages[sizing.train_stage]
    gen = ctx.generator_for(train)
    out = []
    pps, spp, gb, mb = sizing.prompts_per_step, sizing.samples_per_prompt, sizing.global_batch, sizing.micro_batch
    if train.explicit("global_batch") and gb != pps * spp:
        out.append(Diagnostic("RLP301", ERROR, f"global_batch = {gb}, but prompts_per_step x samples_per_prompt = "
                              f"{pps} x {spp} = {pps * spp}", train.span_of("global_batch"),
                              notes=(f"samples_per_prompt = {spp} comes from `{gen.name}`",),
                              help=f"set global_batch = {pps * spp}, or leave it out to derive it"))
    dp = _dp(ctx, train.name)
    if gb % (mb * dp):
        options = [m for m in range(1, gb + 1) if gb % (m * dp) == 0]
        span = train.span_of("micro_batch") if train.explicit("micro_batch") else train.name_span
        out.append(Diagnostic("RLP302", ERROR, f"global_batch = {gb} is not divisible by micro_batch x dp = "
                              f"{mb} x {dp} = {mb * dp}", span,
                              help="micro_batch values that divide it: " + ", ".join(map(str, options[:8]))))
    loss = train.get("loss")
    if loss is not None and loss.name == "grpo" and spp < 2:
        out.append(Diagnostic("RLP303", ERROR, f"GRPO with samples_per_prompt = {spp}: every advantage is zero",
                              gen.span_of("samples_per_prompt"), notes=("GRPO normalises rewards within each "
                                                                        "prompt's group of samples",),
                              help="sample at least 2 responses per prompt (4-16 is typical)"))
    return out


def _dp(ctx: Context, stage: str) -> int:
    sp = ctx.placement.of(ctx.pipe.name, stage) if ctx.placement else None
    return sp.dp if sp and sp.dp else 1


def check_buffer(ctx: Context) -> list[Diagnostic]:
    """RLP304 deadlock proof, RLP305 in-flight limit, RLP306 staleness window."""
    sizing = ctx.sizing()
    if sizing is None:
        return []
    buffer = ctx.pipe.block("buffer")
    pps, lag, cap, inflight = sizing.prompts_per_step, sizing.max_lag, sizing.capacity, sizing.max_inflight
    window = pps * (lag + 1)
    out = []
    if cap < pps:
        out.append(Diagnostic(
            "RLP304", ERROR, f"buffer capacity {cap} < {pps} prompt groups per step: the rollout pump deadlocks",
            buffer.span_of("capacity"),
            notes=(f"a step finishes only after {pps} groups are trained, and trained groups stay stored until the "
                   "step's single clear",
                   f"after {cap} groups the buffer is full: the rollout pump waits for space, the train pump waits "
                   f"for group {cap + 1} of {pps}, and neither can move"),
            help=f"set capacity >= {pps} (>= {window} to fill the max_lag = {lag} window), or leave it out"))
    elif cap < window:
        out.append(Diagnostic(
            "RLP306", WARNING, f"buffer capacity {cap} < prompts_per_step x (max_lag + 1) = {pps} x {lag + 1} = "
            f"{window}: generation cannot run the full {lag} step{'s' * (lag != 1)} ahead", buffer.span_of("capacity"),
            help=f"set capacity = {window} to overlap generation and training fully"))
    if inflight < pps:
        out.append(Diagnostic("RLP305", WARNING, f"max_inflight {inflight} < {pps} prompt groups per step: each "
                              f"step's groups are generated in {-(-pps // inflight)} waves",
                              buffer.span_of("max_inflight"), help=f"set max_inflight >= {pps}, or leave it out"))
    elif inflight > cap and buffer.explicit("max_inflight"):
        out.append(Diagnostic("RLP305", WARNING, f"max_inflight {inflight} > buffer capacity {cap}: the buffer "
                              "caps in-flight groups first, so the limit is never reached",
                              buffer.span_of("max_inflight"), help=f"set max_inflight <= {cap}"))
    return out
