"""Syntax tree -> resolved declarations: block kinds, keys, types, units and
names checked; defaults filled in. Every finding is collected.

What fails to resolve is marked, never replaced: a key written wrongly, set
twice, required but missing, or naming nothing is invalid (no value, no
default); a name declared twice is ambiguous and left out; a dropped block
leaves its pipeline incomplete. The rules read these marks to skip what
they cannot judge (docs/rules.md, "Dependencies")."""

from __future__ import annotations

from itertools import product

from rldsl.compiler import ast
from rldsl.compiler.decls import Decl, FlowEdge, Pipeline, Program, Setting
from rldsl.compiler.diagnostics import ERROR, NO_SPAN, Diagnostic, Span, did_you_mean
from rldsl.compiler.schema import (
    BLOCK_KEYS, BLOCK_KINDS, DERIVED, NAMED_BLOCKS, REQUIRED, SINGLE_BLOCKS, STAGE_KEYS, STAGE_KINDS, Key,
)
from rldsl.compiler.types import INVALID, Ref


def resolve(tree: ast.SourceFile, filename: str = "<input>") -> tuple[Program, list[Diagnostic]]:
    diags: list[Diagnostic] = []
    cluster = _resolve_cluster(tree, diags)
    if not tree.pipelines:
        diags.append(Diagnostic("RLP107", ERROR, "no pipeline declared", NO_SPAN,
                                help="start the file with `pipeline NAME`"))
    resolved, first_seen = [], {}
    for syntax in tree.pipelines:
        if syntax.name.text in first_seen:
            diags.append(_duplicate("pipeline", syntax.name, first_seen[syntax.name.text]))
        first_seen.setdefault(syntax.name.text, syntax.name.span)
        resolved.append(_resolve_pipeline(syntax, diags, len(tree.pipelines) > 1))  # a duplicate's findings too
    names = [p.name for p in resolved]
    ambiguous = frozenset(n for n in names if names.count(n) > 1)
    program = Program(cluster, [p for p in resolved if p.name not in ambiguous], filename,
                      tuple(dict.fromkeys(names)), ambiguous)
    _bind_shares(program, diags)
    _bind_servers(program, diags)
    return program, diags


def _duplicate(what: str, word: ast.Word, first: Span, where: str = "") -> Diagnostic:
    return Diagnostic("RLP102", ERROR, f"{what} `{word.text}` is declared twice{where}", word.span,
                      related=((first, "first declared here"),), help="rename one of them, or remove one")


# ----------------------------------------------------------------- cluster


def _resolve_cluster(tree: ast.SourceFile, diags: list[Diagnostic]) -> Decl:
    """The one cluster; with none, or two, a cluster whose every key is invalid."""
    clusters = []
    for block in tree.shared_blocks:
        if block.kind.text == "cluster":
            clusters.append(block)
        else:
            diags.append(Diagnostic("RLP103", ERROR, f"`{block.kind.text}` blocks belong inside a pipeline",
                                    block.kind.span, help="only the `cluster` block is shared between pipelines: "
                                    f"move this `{block.kind.text}` block into its pipeline"))
    for block in tree.pipelines and [b for p in tree.pipelines for b in p.blocks if b.kind.text == "cluster"]:
        diags.append(Diagnostic("RLP103", ERROR, "the `cluster` block is shared: declare it outside the pipelines",
                                block.kind.span, help="move this block to the top level of the file"))
    if not clusters:
        where = tree.pipelines[0].name.span if tree.pipelines else NO_SPAN
        diags.append(Diagnostic("RLP107", ERROR, "no `cluster` block", where,
                                help="declare the machines, e.g. `cluster { nodes = 1  gpus_per_node = 4 }`"))
        return _unknown_block("cluster", where)
    decls = [_resolve_block(c, "cluster", "cluster", BLOCK_KEYS["cluster"], diags, c.kind.span) for c in clusters]
    for extra in clusters[1:]:
        diags.append(_duplicate("block", extra.kind, clusters[0].kind.span))
    return decls[0] if len(decls) == 1 else _unknown_block("cluster", clusters[0].kind.span)


def _unknown_block(kind: str, span: Span) -> Decl:
    """A block that is missing or written twice: nothing about it is known."""
    return Decl(kind, kind, span, span, invalid=set(BLOCK_KEYS[kind]))


# ---------------------------------------------------------------- pipeline


def _resolve_pipeline(syntax: ast.PipelineSyntax, diags: list[Diagnostic], qualified: bool) -> Pipeline:
    pipe = Pipeline(syntax.name.text, syntax.span, syntax.name.span, qualified=qualified)
    declared: dict[str, Span] = {}  # models, datasets and stages share one namespace
    for block in syntax.blocks:
        _resolve_pipeline_block(pipe, block, declared, diags)
    for name in pipe.ambiguous:
        for table in (pipe.models, pipe.datasets, pipe.environments, pipe.stages):
            table.pop(name, None)
    for flow in syntax.flows:
        for hop_from, hop_to in zip(flow.hops, flow.hops[1:]):
            for src, dst in product(hop_from, hop_to):
                pipe.edges.append(FlowEdge(src.text, dst.text, src.span, dst.span))
    for kind in SINGLE_BLOCKS:  # absent blocks mean all defaults
        if kind not in pipe.blocks:
            pipe.blocks[kind] = _resolve_block(ast.Block((ast.Word(kind, syntax.name.span),), (), syntax.span),
                                               kind, kind, BLOCK_KEYS[kind], diags, syntax.name.span, pipe)
    _bind_references(pipe, diags)
    return pipe


def _resolve_pipeline_block(pipe: Pipeline, block: ast.Block, declared: dict, diags: list[Diagnostic]) -> None:
    kind = block.kind.text
    if kind == "cluster":
        return  # reported by _resolve_cluster
    if kind not in BLOCK_KINDS:
        pipe.complete = False
        diags.append(Diagnostic("RLP103", ERROR, f"unknown block `{kind}`", block.kind.span,
                                help=did_you_mean(kind, BLOCK_KINDS) or "blocks: " + ", ".join(BLOCK_KINDS)))
        return
    arity = {"stage": 3, **{k: 2 for k in NAMED_BLOCKS}}.get(kind, 1)
    if len(block.head) != arity:
        pipe.complete = False
        diags.append(_head_shape(block, kind, arity))
        return
    if kind == "stage":
        _resolve_stage(pipe, block, declared, diags)
    elif kind in NAMED_BLOCKS:
        name = block.head[1]
        decl = _resolve_block(block, kind, name.text, BLOCK_KEYS[kind], diags, name.span, pipe)
        if _claim(pipe, name, declared, diags):
            {"model": pipe.models, "dataset": pipe.datasets, "environment": pipe.environments}[kind][name.text] = decl
    else:
        decl = _resolve_block(block, kind, kind, BLOCK_KEYS[kind], diags, block.kind.span, pipe)
        if kind in pipe.blocks:
            diags.append(_duplicate("block", block.kind, pipe.blocks[kind].name_span, pipe.where))
            pipe.blocks[kind] = _unknown_block(kind, pipe.blocks[kind].name_span)
        else:
            pipe.blocks[kind] = decl


def _head_shape(block: ast.Block, kind: str, arity: int) -> Diagnostic:
    shape = {3: f"`stage KIND NAME {{ ... }}` where KIND is one of {', '.join(STAGE_KINDS)}",
             2: f"`{kind} NAME {{ ... }}`", 1: f"`{kind} {{ ... }}` (it takes no name)"}[arity]
    span = block.head[-1].span if len(block.head) > arity else block.kind.span
    return Diagnostic("RLP104", ERROR, f"malformed `{kind}` block", span, help=f"write {shape}")


def _resolve_stage(pipe: Pipeline, block: ast.Block, declared: dict, diags: list[Diagnostic]) -> None:
    kind_word, name = block.head[1], block.head[2]
    if kind_word.text not in STAGE_KINDS:
        pipe.complete = False
        diags.append(Diagnostic("RLP103", ERROR, f"unknown stage kind `{kind_word.text}`", kind_word.span,
                                help=did_you_mean(kind_word.text, STAGE_KINDS) or "kinds: " + ", ".join(STAGE_KINDS)))
        return
    decl = _resolve_block(block, "stage", name.text, STAGE_KEYS[kind_word.text], diags, name.span, pipe)
    decl.stage_kind = kind_word.text
    if _claim(pipe, name, declared, diags):
        pipe.stages[name.text] = decl


def _claim(pipe: Pipeline, name: ast.Word, declared: dict, diags: list[Diagnostic]) -> bool:
    if name.text in declared:
        diags.append(_duplicate("name", name, declared[name.text], pipe.where))
        pipe.ambiguous.add(name.text)
        return False
    declared[name.text] = name.span
    return True


def _resolve_block(block: ast.Block, kind: str, name: str, keys: dict[str, Key], diags: list[Diagnostic],
                   name_span: Span, pipe: Pipeline | None = None) -> Decl:
    decl = Decl(kind, name, block.span, name_span)
    what = _what(kind, name) + (pipe.where if pipe else "")
    written: dict[str, Span] = {}
    for entry in block.entries:
        key = entry.key.text
        if key not in keys:
            diags.append(Diagnostic("RLP103", ERROR, f"unknown key `{key}` in {what}", entry.key.span,
                                    help=did_you_mean(key, keys) or _key_elsewhere(key, kind) or
                                    "keys: " + ", ".join(keys)))
            continue
        value, errors = _convert(keys[key], entry)
        diags.extend(errors)
        if key in written:
            diags.append(Diagnostic("RLP102", ERROR, f"key `{key}` is set twice", entry.key.span,
                                    related=((written[key], "first set here"),),
                                    help=f"keep one `{key} = ...`: which one was meant is unknown"))
            decl.invalid.add(key)
            decl.settings.pop(key, None)
            continue
        written[key] = entry.key.span
        if value is INVALID:
            decl.invalid.add(key)
        else:
            decl.settings[key] = Setting(value, entry.value.span if entry.value else entry.key.span, True,
                                         _item_spans(entry.value))
    for key, spec in keys.items():
        if key in written:
            continue
        if spec.default is REQUIRED:
            decl.invalid.add(key)
            diags.append(Diagnostic("RLP107", ERROR, f"{what} is missing `{key}`", name_span,
                                    help=f"add `{key} = ...`: {spec.doc}"))
        else:
            decl.settings[key] = Setting(None if spec.default is DERIVED else spec.default, None, False)
    return decl


def _item_spans(value: ast.Value | None) -> tuple[Span, ...]:
    return tuple(item.span for item in value.items) if isinstance(value, ast.ListValue) else ()


def _convert(spec: Key, entry: ast.Entry):
    if entry.value is None:  # a bare flag: `frozen` means `frozen = true`
        return spec.type.convert(ast.Name("true", entry.key.span))
    if _holds_out_of_range(entry.value):  # the parser's RLP106 is its one finding
        return INVALID, []
    return spec.type.convert(entry.value)


def _holds_out_of_range(value: ast.Value) -> bool:
    if isinstance(value, ast.OutOfRange):
        return True
    if isinstance(value, ast.Range):
        return _holds_out_of_range(value.low) or _holds_out_of_range(value.high)
    if isinstance(value, ast.ListValue):
        return any(_holds_out_of_range(item) for item in value.items)
    if isinstance(value, ast.Call):
        return any(_holds_out_of_range(arg.value) for arg in value.args)
    return False


def _key_elsewhere(key: str, kind: str) -> str | None:
    """For a stage key that belongs to other stage kinds (`environment` on a reward stage): which."""
    owners = [k for k, keys in STAGE_KEYS.items() if key in keys] if kind == "stage" else []
    return f"`{key}` is a key of {' and '.join(owners)} stages" if owners else None


def _what(kind: str, name: str) -> str:
    return f"{kind} `{name}`" if kind != name else f"`{kind}`"


# -------------------------------------------------------------- references


def _bind_references(pipe: Pipeline, diags: list[Diagnostic]) -> None:
    for decl in pipe.stages.values():
        for key, setting in list(decl.settings.items()):
            if key == "served_by":  # a pipeline of the file (_bind_servers)
                continue
            table, what = {"model": (pipe.models, "model"), "environment": (pipe.environments, "environment")}.get(
                key, (pipe.stages, "stage"))
            unknown = [ref for ref in _refs(setting.value) if not _check_ref(pipe, ref, table, what, diags)]
            if unknown:  # every unknown name is reported, then the key is invalid
                decl.invalid.add(key)
                del decl.settings[key]
    placement = pipe.blocks["placement"]
    refs = [ref for group in placement.get("groups") or () for ref in group]
    if [ref for ref in refs if not _check_ref(pipe, ref, pipe.stages, "stage", diags)]:
        placement.invalid.add("groups")
        del placement.settings["groups"]
    nodes = {**pipe.datasets, **pipe.stages}
    for edge in pipe.edges:
        for name, span in ((edge.src, edge.src_span), (edge.dst, edge.dst_span)):
            if not _check_ref(pipe, Ref(name, span), nodes, "dataset or stage", diags):
                pipe.flows_valid = False


def _refs(value) -> list[Ref]:
    if isinstance(value, Ref):
        return [value]
    if isinstance(value, tuple):
        return [r for item in value for r in _refs(item)]
    return []


def _check_ref(pipe: Pipeline, ref: Ref, table: dict, what: str, diags: list[Diagnostic]) -> bool:
    """Whether ``ref`` names one declaration; an ambiguous name is invalid without a finding of its own."""
    if ref.name in table:
        return True
    if ref.name not in pipe.ambiguous:
        diags.append(_unknown_name(ref, what, table, pipe.where))
    return False


def _unknown_name(ref: Ref, what: str, table, where: str = "") -> Diagnostic:
    known = [n for n in table]
    help_text = did_you_mean(ref.name, known) or (f"declared: {', '.join(known)}" if known
                                                   else f"declare a {what.split(' or ')[0]} `{ref.name}` first")
    return Diagnostic("RLP101", ERROR, f"no {what} named `{ref.name}`{where}", ref.span, help=help_text)


def _bind_servers(program: Program, diags: list[Diagnostic]) -> None:
    """A generate stage's `served_by` names another pipeline of the file."""
    for pipe in program.pipelines:
        for stage in pipe.stages.values():
            ref = stage.get("served_by")
            if ref is None or ref.name in program.pipeline_names and ref.name not in program.ambiguous_pipelines:
                continue
            if ref.name not in program.ambiguous_pipelines:
                others = [n for n in program.pipeline_names if n != pipe.name]
                diags.append(_unknown_name(ref, "pipeline", others) if others else Diagnostic(
                    "RLP101", ERROR, f"no pipeline named `{ref.name}`", ref.span,
                    help="`served_by` names another pipeline of the file, whose generator serves this stage"))
            stage.invalid.add("served_by")
            del stage.settings["served_by"]


def _bind_shares(program: Program, diags: list[Diagnostic]) -> None:
    """`placement { share = [...] }` names other pipelines of the file."""
    for pipe in program.pipelines:
        placement = pipe.blocks["placement"]
        ok = True
        for ref in placement.get("share") or ():
            if ref.name == pipe.name:
                ok = False
                diags.append(Diagnostic("RLP104", ERROR, f"pipeline `{pipe.name}` names itself in `share`", ref.span,
                                        help="`share` names the other pipelines whose GPUs this one may use"))
            elif ref.name not in program.pipeline_names:
                ok = False
                others = [n for n in program.pipeline_names if n != pipe.name]
                diags.append(_unknown_name(ref, "pipeline", others) if others else Diagnostic(
                    "RLP101", ERROR, f"no pipeline named `{ref.name}`", ref.span,
                    help="this file has one pipeline: remove `share`"))
            elif ref.name in program.ambiguous_pipelines:
                ok = False
        if not ok:
            placement.invalid.add("share")
            placement.settings.pop("share", None)
