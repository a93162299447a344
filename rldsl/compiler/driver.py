"""The compiler's front door: text -> diagnostics and, when clean, a plan.

    parse -> resolve -> old meanings -> IR -> dataflow, weight and engine
    rules -> placement -> sharing, batch, buffer and memory rules (logprob
    forwards cut to fit) -> lowering

An old form a file was written in before a rule tightened is read as its
current form, with a warning (old_meanings.py, memory_fit.py): files that
checked keep checking and mean what they meant.

Each step is a pure function; findings are collected, then ordered by
cause: a finding that explains others (``Diagnostic.explains``) comes
first with them folded under it, none dropped. Every rule runs
whenever its own inputs resolved, whatever else in the file is wrong: a
value that did not resolve is marked invalid (never replaced by a default)
and the rules reading it are skipped, so one mistake is reported once and
never makes another rule report numbers the file does not hold
(docs/rules.md lists what each rule depends on).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Program
from rldsl.compiler.diagnostics import ERROR, NO_SPAN, Diagnostic, order_by_cause
from rldsl.compiler.ir import build_ir
from rldsl.compiler.old_meanings import keep_old_meanings
from rldsl.compiler.parser import BYTE_ORDER_MARK, parse
from rldsl.compiler.placement import Placement, place
from rldsl.compiler.resolve import resolve
from rldsl.compiler.rules import (
    batching, dataflow, engines, environments, experts, forwards, launch, learning, lora, noops, reward_models,
    served, sharing, training, weights,
)

if TYPE_CHECKING:  # the plan type only: lowering imports it when a plan is made
    from rldsl.plan import ExecutionPlan

PIPELINE_PASSES = dataflow.PASSES + weights.PASSES + engines.PASSES + training.PASSES + learning.PASSES + \
    environments.PASSES + reward_models.PASSES + forwards.PASSES + launch.PASSES + lora.PASSES + served.PASSES + noops.PASSES
PROGRAM_PLACED_PASSES = (sharing.check_sharing, sharing.check_pipeline_sharing)
# these read the placement when there is one
PLACED_PASSES = batching.PASSES + experts.PASSES + (sharing.check_on_policy_disjoint, weights.check_transport) + launch.PLACED_PASSES + \
    served.PLACED_PASSES


@dataclass
class CompileResult:
    filename: str
    source: str
    diagnostics: list[Diagnostic] = field(default_factory=list)
    program: Program | None = None
    contexts: list[Context] = field(default_factory=list)
    placement: Placement | None = None
    memory: list = field(default_factory=list)  # rldsl.compiler.memory.GpuMemory per GPU, for `plan`
    plan: "ExecutionPlan | None" = None  # rldsl.plan.ExecutionPlan

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)


def compile_source(text: str, filename: str = "<input>", base_dir: Path | None = None,
                   want_plan: bool = True) -> CompileResult:
    base_dir = base_dir or Path(".")
    text = text.removeprefix(BYTE_ORDER_MARK)  # columns then count as an editor shows them
    result = CompileResult(filename, text)
    tree, diags = parse(text)
    if tree is None:
        result.diagnostics = diags
        return result
    program, found = resolve(tree, filename)
    program, kept = keep_old_meanings(program)  # an old form read as the current one, with a warning
    diags = diags + found + kept
    result.program = program
    result.contexts = [Context(program, pipe, build_ir(pipe)) for pipe in program.pipelines]
    for ctx in result.contexts:
        for check in PIPELINE_PASSES:
            diags += check(ctx)
    placement, found = place(program)
    diags += found
    result.placement = placement
    if placement is not None:
        for check in PROGRAM_PLACED_PASSES:
            diags += check(program, placement)
    for ctx in result.contexts:
        ctx.placement = placement
        for check in PLACED_PASSES:
            diags += check(ctx)
    if placement is not None and (want_plan or program.cluster.get("gpu_memory")):
        from rldsl.compiler.memory import check_memory, estimate  # `check` needs it only with a GPU size

        found = check_memory(program, placement, base_dir)
        if found:  # forwards cut to fit keep the file's meaning: a warning rather than RLP506 (memory_fit.py)
            found = _fit_forwards(result, base_dir, text, found)
            program = result.program
        diags += found
        result.memory = estimate(program, placement, base_dir)
        diags = sharing.explain_memory(program, diags, result.memory)
        diags = sharing.allow_resident_trainers(program, placement, diags, result.memory)
    result.diagnostics = order_by_cause(diags)
    if result.ok:  # `check` too: a plan that checks must be one Ray can lay out (RLP512)
        plan = _lower(result, base_dir)
        result.diagnostics = order_by_cause(diags + check_layout(plan, program))
        result.plan = plan if want_plan and result.ok else None
    return result


def _fit_forwards(result: CompileResult, base_dir: Path, text: str, found: list[Diagnostic]) -> list[Diagnostic]:
    """RLP506's findings, or the RLP520 warnings of the logprob forwards cut to fit (the program and contexts
    of ``result`` then hold the fitted settings, which the plan carries)."""
    from rldsl.compiler.memory_fit import fit_logprob_forwards

    fitted = fit_logprob_forwards(result.program, result.placement, base_dir, text)
    if fitted is None:
        return found
    result.program, warnings = fitted
    result.contexts = [Context(result.program, pipe, build_ir(pipe), result.placement)
                       for pipe in result.program.pipelines]
    return warnings


def check_layout(plan, program: Program) -> list[Diagnostic]:
    """RLP512: the launcher's own bundle layout (rldsl.layout), run on the plan."""
    from rldsl.layout import LayoutError, actor_slots, layout_bundles

    try:
        layout_bundles(actor_slots(plan), actor_cpus=0.0)
    except LayoutError as error:
        decl = next((p.stages[error.stage] for p in program.pipelines if error.stage in p.stages), None)
        span = decl.name_span if decl is not None else NO_SPAN
        message, _, fix = str(error).rpartition(". ")
        return [Diagnostic("RLP512", ERROR, f"placement Ray cannot lay out: {message}", span,
                           help=(fix[:1].lower() + fix[1:]) if fix else None)]
    return []


def _lower(result: CompileResult, base_dir: Path):
    from rldsl.compiler.lowering import lower  # imported here: `check` needs no plan
    from rldsl.compiler.memory import model_params

    program = result.program
    params = {f"{pipe.name}/{m.name}": model_params(m, base_dir)
              for pipe in program.pipelines for m in pipe.models.values()}
    warnings = [f"warning[{d.code}]: {d.message}" for d in result.diagnostics]
    digest = hashlib.sha256(result.source.encode()).hexdigest()
    return lower(program, result.contexts, result.placement, params, warnings, digest, base_dir)


def compile_file(path: str | Path, want_plan: bool = True) -> CompileResult:
    """Raises OSError / UnicodeDecodeError for an unreadable file (a usage error)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    return compile_source(text, str(path), base_dir=path.parent, want_plan=want_plan)
