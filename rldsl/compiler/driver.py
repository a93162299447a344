"""The compiler's front door: text -> diagnostics and, when clean, a plan.

    parse -> resolve -> IR -> dataflow rules -> placement -> placement,
    batch and memory rules -> lowering

Each step is a pure function; findings are collected. Semantic rules run
only on files that parse and resolve: they would otherwise report the
consequences of a typo rather than its cause.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Program
from rldsl.compiler.diagnostics import Diagnostic, sort_diagnostics
from rldsl.compiler.ir import build_ir
from rldsl.compiler.parser import parse
from rldsl.compiler.placement import Placement, place
from rldsl.compiler.resolve import resolve
from rldsl.compiler.rules import batching, dataflow, sharing

PIPELINE_PASSES = dataflow.PASSES
PLACED_PASSES = (batching.check_batch_sizes, batching.check_buffer, sharing.check_on_policy_disjoint)


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
    result = CompileResult(filename, text)
    tree, diags = parse(text)
    if tree is None:
        result.diagnostics = diags
        return result
    program, diags = resolve(tree, filename)
    if program is None or any(d.is_error for d in diags):
        result.diagnostics = sort_diagnostics(diags)
        return result
    result.program = program
    result.contexts = [Context(program, pipe, build_ir(pipe)) for pipe in program.pipelines]
    for ctx in result.contexts:
        for check in PIPELINE_PASSES:
            diags += check(ctx)
    structural_errors = any(d.is_error for d in diags)
    placement, placement_diags = place(program)
    diags += placement_diags
    result.placement = placement
    if not placement_diags:
        diags += sharing.check_sharing(program, placement)
        for ctx in result.contexts:
            ctx.placement = placement
    if not structural_errors:
        for ctx in result.contexts:
            for check in PLACED_PASSES:
                diags += check(ctx)
    if not placement_diags and (want_plan or program.cluster.get("gpu_memory")):
        from rldsl.compiler.memory import check_memory, estimate  # `check` needs it only with a GPU size

        diags += check_memory(program, placement, base_dir)
        result.memory = estimate(program, placement, base_dir)
    result.diagnostics = sort_diagnostics(diags)
    if result.ok and want_plan:
        result.plan = _lower(result, base_dir)
    return result


def _lower(result: CompileResult, base_dir: Path):
    from rldsl.compiler.lowering import lower  # imported here: `check` needs no plan
    from rldsl.compiler.memory import model_params

    program = result.program
    params = {f"{pipe.name}/{m.name}": model_params(m, base_dir) for pipe in program.pipelines for m in pipe.models.values()}
    warnings = [f"warning[{d.code}]: {d.message}" for d in result.diagnostics]
    digest = hashlib.sha256(result.source.encode()).hexdigest()
    return lower(program, result.contexts, result.placement, params, warnings, digest, base_dir)


def compile_file(path: str | Path, want_plan: bool = True) -> CompileResult:
    """Raises OSError / UnicodeDecodeError for an unreadable file (a usage error)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    return compile_source(text, str(path), base_dir=path.parent, want_plan=want_plan)
