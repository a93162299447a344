"""RLP520: logprob forwards made to fit the GPU, with a warning, instead of
an RLP506 error.

How many rows a logprob stage scores per forward (`micro_batch`), and
whether an fsdp logprob stage holds a whole copy of the model per rank or
shards it (`fsdp(shard = 0)`), change its memory and nothing it computes:
the same logprobs come out. Files written before the memory estimate
counted a logprob forward beside every phase of the stages on its GPUs
(the shipped OpenRLHF translation scored 16 rows with a whole copy per
rank) now exceed their GPUs; rather than refuse them, `check` shards such
a stage and halves its rows until every GPU fits, and says so. The plan
carries the fitted settings, and `rldsl fmt --fix` writes them into the
file (old_meanings.py). Where no such setting makes the GPUs fit, the
file is left as written and RLP506 reports it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rldsl.compiler.decls import Decl, Program
from rldsl.compiler.diagnostics import WARNING, Diagnostic, Span
from rldsl.compiler.memory import GpuMemory, estimate
from rldsl.compiler.placement import Placement
from rldsl.compiler.units import format_bytes

FITTED = "RLP520"
# Engines whose forwards rldsl sizes by `micro_batch` (vLLM and SGLang schedule their own).
SIZED_ENGINES = ("torch", "fsdp", "megatron")


@dataclasses.dataclass(frozen=True)
class Fit:
    shard: frozenset[tuple[str, str]]  # (pipeline, stage): fsdp logprob stages sharded over their ranks
    rows: dict[tuple[str, str], int]  # (pipeline, stage) -> rows per forward


def fit_logprob_forwards(program: Program, placement: Placement, base_dir: Path,
                         source: str) -> tuple[Program, list[Diagnostic]] | None:
    """The program with its over-full GPUs' logprob forwards made to fit, and
    a warning per stage changed; None when nothing it may change makes them fit."""
    capacity = program.cluster.get("gpu_memory")
    before = estimate(program, placement, base_dir)
    over = [m for m in before if m.used > capacity and m.by_stage]
    stages = _sizable(program, placement, over)
    for fit in _fits(program, placement, stages):
        fitted = _apply(program, fit)
        after = estimate(fitted, placement, base_dir)
        if all(m.used <= capacity for m in after):
            lines = source.replace("\r\n", "\n").split("\n")
            return fitted, [_warning(program, key, fit, lines, over, after) for key in stages
                            if _changed(program, key, fit)]
    return None


def _sizable(program: Program, placement: Placement, over: list[GpuMemory]) -> list[tuple[str, str]]:
    """The logprob stages on the over-full GPUs whose forwards rldsl sizes by rows."""
    names = {name for m in over for name, _ in m.by_stage}
    out = []
    for name in sorted(names):
        pipeline, stage = name.split("/")
        decl = program.pipeline(pipeline).stages[stage]
        if decl.stage_kind == "logprob" and decl.valid("engine", "micro_batch", "micro_batch_tokens") \
                and decl["engine"].name in SIZED_ENGINES and not decl.get("micro_batch_tokens"):
            out.append((pipeline, stage))
    return out


def _fits(program: Program, placement: Placement, stages: list[tuple[str, str]]):
    """The candidate settings, least changed first: every unsharded fsdp stage sharded over its ranks, then
    the rows per forward halved, all stages at once, down to one."""
    shardable = frozenset(key for key in stages if _shardable(_stage(program, key), placement.stages[key].dp))
    rows = {key: _stage(program, key)["micro_batch"] for key in stages}
    if shardable:
        yield Fit(shardable, rows)
    while any(r > 1 for r in rows.values()):
        rows = {key: max(1, r // 2) for key, r in rows.items()}
        yield Fit(shardable, rows)


def _shardable(stage: Decl, dp: int) -> bool:
    engine = stage["engine"]
    return engine.name == "fsdp" and "shard" not in (engine.arg_spans or {}) and dp > 1


def _stage(program: Program, key: tuple[str, str]) -> Decl:
    return program.pipeline(key[0]).stages[key[1]]


def _apply(program: Program, fit: Fit) -> Program:
    pipelines = []
    for pipe in program.pipelines:
        stages = dict(pipe.stages)
        for key, rows in fit.rows.items():
            if key[0] == pipe.name:
                stages[key[1]] = _fitted_stage(stages[key[1]], key in fit.shard, rows)
        pipelines.append(dataclasses.replace(pipe, stages=stages))
    return dataclasses.replace(program, pipelines=pipelines)


def _fitted_stage(stage: Decl, shard: bool, rows: int) -> Decl:
    settings = dict(stage.settings)
    settings["micro_batch"] = settings["micro_batch"]._replace(value=rows)
    if shard:
        engine = stage["engine"]
        sharded = engine._replace(args={**engine.args, "shard": 0},
                                  arg_spans={**(engine.arg_spans or {}), "shard": engine.span})
        settings["engine"] = settings["engine"]._replace(value=sharded)
    return dataclasses.replace(stage, settings=settings)


def _warning(program: Program, key: tuple[str, str], fit: Fit, lines: list[str], over: list[GpuMemory],
             after: list[GpuMemory]) -> Diagnostic:
    stage, sharded, rows = _stage(program, key), key in fit.shard, fit.rows[key]
    resized = rows != stage["micro_batch"]
    what = (["its model sharded over its ranks (`shard = 0`)"] if sharded else []) + \
        ([f"{rows} rows per forward (`micro_batch = {rows}`)"] if resized else [])
    written = (["`shard = 0` in its engine"] if sharded else []) + ([f"`micro_batch = {rows}`"] if resized else [])
    changes = ([_shard_change(stage)] if sharded else []) + ([_rows_change(stage, rows)] if resized else [])
    mine = [m for m in over if any(name == "/".join(key) for name, _ in m.by_stage)]
    now = max(m.used for m in after if m.gpu in {g.gpu for g in mine})
    capacity = program.cluster["gpu_memory"]
    return Diagnostic(
        FITTED, WARNING, f"{program.label(*key)} would overfill GPU {mine[0].gpu} (about "
        f"{format_bytes(max(m.used for m in mine))} of its {format_bytes(capacity)}): it scores with "
        f"{' and '.join(what)}", stage.name_span,
        notes=(f"so the GPU needs about {format_bytes(now)}; how a logprob stage cuts its forwards changes its "
               f"memory, not the logprobs it computes",),
        help=f"write {' and '.join(written)} (`rldsl fmt --fix` does)", edit=_one_edit(lines, changes))


def _changed(program: Program, key: tuple[str, str], fit: Fit) -> bool:
    return key in fit.shard or fit.rows[key] != _stage(program, key)["micro_batch"]


def _shard_change(stage: Decl) -> tuple[Span, str]:
    """`shard = 0` as the engine's first argument, or the call opened for it."""
    engine = stage["engine"]
    if engine.arg_spans:
        first = min(engine.arg_spans.values())
        return Span(first.line, first.col, first.line, first.col), "shard = 0, "
    return engine.span, f"{engine.name}(shard = 0)"


def _rows_change(stage: Decl, rows: int) -> tuple[Span, str]:
    """The written `micro_batch` value, or `micro_batch = N` added after the stage's `model`."""
    if stage.explicit("micro_batch"):
        return stage.span_of("micro_batch"), str(rows)
    at = stage.span_of("model")
    return Span(at.end_line, at.end_col, at.end_line, at.end_col), f"  micro_batch = {rows}"


def _one_edit(lines: list[str], changes: list[tuple[Span, str]]) -> tuple[Span, str]:
    """Several changes as one edit: the text from the first to the last, each change made in it."""
    changes = sorted(changes)
    start, end = changes[0][0], max(span for span, _ in changes)
    text = "\n".join(lines)
    offset = _offsets(lines)
    begin, finish = offset(start.line, start.col), offset(end.end_line, end.end_col)
    region = text[begin:finish]
    for span, replacement in reversed(changes):
        a, b = offset(span.line, span.col) - begin, offset(span.end_line, span.end_col) - begin
        region = region[:a] + replacement + region[b:]
    return Span(start.line, start.col, end.end_line, end.end_col), region


def _offsets(lines: list[str]):
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)
    return lambda line, col: starts[line - 1] + col - 1
