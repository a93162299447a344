"""Syntax tree -> resolved declarations: block kinds, keys, types, units and
names checked; defaults filled in. Every finding is collected."""

from __future__ import annotations

from itertools import product

from rldsl.compiler import ast
from rldsl.compiler.decls import Decl, FlowEdge, Pipeline, Program, Setting
from rldsl.compiler.diagnostics import ERROR, NO_SPAN, Diagnostic, Span, did_you_mean
from rldsl.compiler.schema import (
    BLOCK_KEYS, BLOCK_KINDS, DERIVED, NAMED_BLOCKS, REQUIRED, SINGLE_BLOCKS, STAGE_KEYS, STAGE_KINDS, Key,
)
from rldsl.compiler.types import INVALID, Ref


def resolve(tree: ast.SourceFile, filename: str = "<input>") -> tuple[Program | None, list[Diagnostic]]:
    diags: list[Diagnostic] = []
    cluster = _resolve_cluster(tree, diags)
    if not tree.pipelines:
        diags.append(Diagnostic("RLP107", ERROR, "no pipeline declared", NO_SPAN,
                                help="start the file with `pipeline NAME`"))
    pipelines, seen = [], {}
    for syntax in tree.pipelines:
        if syntax.name.text in seen:
            diags.append(_duplicate("pipeline", syntax.name, seen[syntax.name.text]))
            continue
        seen[syntax.name.text] = syntax.name.span
        pipelines.append(_resolve_pipeline(syntax, diags))
    if cluster is None:
        return None, diags
    return Program(cluster, pipelines, filename), diags


def _duplicate(what: str, word: ast.Word, first: Span) -> Diagnostic:
    return Diagnostic("RLP102", ERROR, f"{what} `{word.text}` is declared twice", word.span,
                      related=((first, "first declared here"),), help="rename one of them")


# ----------------------------------------------------------------- cluster


def _resolve_cluster(tree: ast.SourceFile, diags: list[Diagnostic]) -> Decl | None:
    clusters = []
    for block in tree.shared_blocks:
        if block.kind.text == "cluster":
            clusters.append(block)
        else:
            diags.append(Diagnostic("RLP103", ERROR, f"`{block.kind.text}` blocks belong inside a pipeline",
                                    block.kind.span, help="only the `cluster` block is shared between pipelines"))
    for block in tree.pipelines and [b for p in tree.pipelines for b in p.blocks if b.kind.text == "cluster"]:
        diags.append(Diagnostic("RLP103", ERROR, "the `cluster` block is shared: declare it outside the pipelines",
                                block.kind.span))
    if not clusters:
        where = tree.pipelines[0].name.span if tree.pipelines else NO_SPAN
        diags.append(Diagnostic("RLP107", ERROR, "no `cluster` block", where,
                                help="declare the machines, e.g. `cluster { nodes = 1  gpus_per_node = 4 }`"))
        return None
    for extra in clusters[1:]:
        diags.append(_duplicate("block", extra.kind, clusters[0].kind.span))
    return _resolve_block(clusters[0], "cluster", "cluster", BLOCK_KEYS["cluster"], diags, clusters[0].kind.span)


# ---------------------------------------------------------------- pipeline


def _resolve_pipeline(syntax: ast.PipelineSyntax, diags: list[Diagnostic]) -> Pipeline:
    pipe = Pipeline(syntax.name.text, syntax.span, syntax.name.span)
    declared: dict[str, Span] = {}  # models, datasets and stages share one namespace
    for block in syntax.blocks:
        _resolve_pipeline_block(pipe, block, declared, diags)
    for flow in syntax.flows:
        for hop_from, hop_to in zip(flow.hops, flow.hops[1:]):
            for src, dst in product(hop_from, hop_to):
                pipe.edges.append(FlowEdge(src.text, dst.text, src.span, dst.span))
    for kind in SINGLE_BLOCKS:  # absent blocks mean all defaults
        if kind not in pipe.blocks:
            pipe.blocks[kind] = _resolve_block(ast.Block((ast.Word(kind, syntax.name.span),), (), syntax.span),
                                               kind, kind, BLOCK_KEYS[kind], diags, syntax.name.span)
    _bind_references(pipe, diags)
    return pipe


def _resolve_pipeline_block(pipe: Pipeline, block: ast.Block, declared: dict, diags: list[Diagnostic]) -> None:
    kind = block.kind.text
    if kind == "cluster":
        return  # reported by _resolve_cluster
    if kind not in BLOCK_KINDS:
        diags.append(Diagnostic("RLP103", ERROR, f"unknown block `{kind}`", block.kind.span,
                                help=did_you_mean(kind, BLOCK_KINDS) or "blocks: " + ", ".join(BLOCK_KINDS)))
        return
    arity = {"stage": 3, **{k: 2 for k in NAMED_BLOCKS}}.get(kind, 1)
    if len(block.head) != arity:
        diags.append(_head_shape(block, kind, arity))
        return
    if kind == "stage":
        _resolve_stage(pipe, block, declared, diags)
    elif kind in NAMED_BLOCKS:
        name = block.head[1]
        if _claim(name, declared, diags):
            table = pipe.models if kind == "model" else pipe.datasets
            table[name.text] = _resolve_block(block, kind, name.text, BLOCK_KEYS[kind], diags, name.span)
    elif kind in pipe.blocks:
        diags.append(_duplicate("block", block.kind, pipe.blocks[kind].name_span))
    else:
        pipe.blocks[kind] = _resolve_block(block, kind, kind, BLOCK_KEYS[kind], diags, block.kind.span)


def _head_shape(block: ast.Block, kind: str, arity: int) -> Diagnostic:
    shape = {3: f"`stage KIND NAME {{ ... }}` where KIND is one of {', '.join(STAGE_KINDS)}",
             2: f"`{kind} NAME {{ ... }}`", 1: f"`{kind} {{ ... }}` (it takes no name)"}[arity]
    span = block.head[-1].span if len(block.head) > arity else block.kind.span
    return Diagnostic("RLP104", ERROR, f"malformed `{kind}` block", span, help=f"write {shape}")


def _resolve_stage(pipe: Pipeline, block: ast.Block, declared: dict, diags: list[Diagnostic]) -> None:
    kind_word, name = block.head[1], block.head[2]
    if kind_word.text not in STAGE_KINDS:
        diags.append(Diagnostic("RLP103", ERROR, f"unknown stage kind `{kind_word.text}`", kind_word.span,
                                help=did_you_mean(kind_word.text, STAGE_KINDS) or "kinds: " + ", ".join(STAGE_KINDS)))
        return
    if _claim(name, declared, diags):
        decl = _resolve_block(block, "stage", name.text, STAGE_KEYS[kind_word.text], diags, name.span)
        decl.stage_kind = kind_word.text
        pipe.stages[name.text] = decl


def _claim(name: ast.Word, declared: dict, diags: list[Diagnostic]) -> bool:
    if name.text in declared:
        diags.append(_duplicate("name", name, declared[name.text]))
        return False
    declared[name.text] = name.span
    return True


def _resolve_block(block: ast.Block, kind: str, name: str, keys: dict[str, Key], diags: list[Diagnostic],
                   name_span: Span) -> Decl:
    decl = Decl(kind, name, block.span, name_span)
    for entry in block.entries:
        key = entry.key.text
        if key not in keys:
            diags.append(Diagnostic("RLP103", ERROR, f"unknown key `{key}` in {_what(kind, name)}", entry.key.span,
                                    help=did_you_mean(key, keys) or "keys: " + ", ".join(keys)))
            continue
        if key in decl.settings:
            diags.append(Diagnostic("RLP102", ERROR, f"key `{key}` is set twice", entry.key.span,
                                    related=((decl.settings[key].span, "first set here"),)))
            continue
        value, errors = _convert(keys[key], entry)
        diags.extend(errors)
        if value is not INVALID:
            decl.settings[key] = Setting(value, entry.value.span if entry.value else entry.key.span, True)
    for key, spec in keys.items():
        if key in decl.settings:
            continue
        if spec.default is REQUIRED:
            diags.append(Diagnostic("RLP107", ERROR, f"{_what(kind, name)} is missing `{key}`", name_span,
                                    help=f"add `{key} = ...`: {spec.doc}"))
        else:
            decl.settings[key] = Setting(None if spec.default is DERIVED else spec.default, None, False)
    return decl


def _convert(spec: Key, entry: ast.Entry):
    if entry.value is None:  # a bare flag: `frozen` means `frozen = true`
        return spec.type.convert(ast.Name("true", entry.key.span))
    return spec.type.convert(entry.value)


def _what(kind: str, name: str) -> str:
    return f"{kind} `{name}`" if kind != name else f"`{kind}`"


# -------------------------------------------------------------- references


def _bind_references(pipe: Pipeline, diags: list[Diagnostic]) -> None:
    for decl in [*pipe.stages.values()]:
        for key, setting in decl.settings.items():
            for ref in _refs(setting.value):
                table = pipe.models if key == "model" else pipe.stages
                _check_ref(ref, table, "model" if key == "model" else "stage", diags)
    placement = pipe.blocks["placement"]
    for group in placement.get("groups") or ():
        for ref in group:
            _check_ref(ref, pipe.stages, "stage", diags)
    nodes = {**pipe.datasets, **pipe.stages}
    for edge in pipe.edges:
        for name, span in ((edge.src, edge.src_span), (edge.dst, edge.dst_span)):
            _check_ref(Ref(name, span), nodes, "dataset or stage", diags)


def _refs(value) -> list[Ref]:
    if isinstance(value, Ref):
        return [value]
    if isinstance(value, tuple):
        return [r for item in value for r in _refs(item)]
    return []


def _check_ref(ref: Ref, table: dict, what: str, diags: list[Diagnostic]) -> None:
    if ref.name not in table:
        diags.append(Diagnostic("RLP101", ERROR, f"no {what} named `{ref.name}`", ref.span,
                                help=did_you_mean(ref.name, table) or (f"declared: {', '.join(table)}" if table else None)))
