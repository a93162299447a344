"""`--set TARGET.KEY=VALUE`: a setting changed from the command line.

VALUE is parsed as one value of the key's type, never taken as text: a key
that holds a string takes VALUE as that string (quoted for it), any other
key takes exactly one value of the language (a number, a name, a list, a
call), so no VALUE can close the block or add a declaration. The value,
written out from its parse, replaces the key's value in the source, then
the text is checked like any file: a wrong value is the same finding it
would be in the file, and the plan is the plan of the file as overridden.
TARGET names a block the way a file does: a stage, model or dataset by its
name, or a singleton block by its kind (`run`, `staleness`, `buffer`,
`placement`, `cluster`); with several pipelines, `PIPELINE.TARGET.KEY`.

Edits keep every line where it was (a key added to a block goes before
its closing brace, on that line; a missing singleton block goes at the
end), so every finding's line number is the file's own.
"""

from __future__ import annotations

import difflib

import re

from rldsl.compiler import ast
from rldsl.compiler.parser import parse
from rldsl.compiler.reward_types import RewardFns
from rldsl.compiler.schema import BLOCK_KEYS, STAGE_KEYS
from rldsl.compiler.types import Str

SINGLETON_BLOCKS = ("run", "staleness", "buffer", "placement", "cluster")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # the grammar's NAME: a target or key is nothing else


class OverrideError(ValueError):
    """An override that names nothing, is not written `TARGET.KEY=VALUE`, or whose VALUE is not one value."""


def apply_overrides(source: str, overrides: list[str]) -> str:
    """``source`` with every override written in, in order (a later one wins).
    A file that does not parse is returned as it is: its syntax error is
    the finding to show."""
    for override in overrides:
        path, value = split_override(override)
        tree, _ = parse(source)
        if tree is None:
            return source
        source = _apply(source, tree, path, value, override)
    return source


def split_override(override: str) -> tuple[list[str], str]:
    target, equals, value = override.partition("=")
    path = [part.strip() for part in target.split(".")]
    if not equals or not value.strip() or len(path) not in (2, 3) or not all(_NAME.fullmatch(p) for p in path):
        raise OverrideError(f"`--set {override}`: write TARGET.KEY=VALUE (for example `actor.lr=1e-5`, "
                            "`run.steps=100`; with several pipelines PIPELINE.TARGET.KEY=VALUE)")
    return path, value.strip()


def _apply(source: str, tree: ast.SourceFile, path: list[str], raw: str, override: str) -> str:
    *where, key = path
    pipeline, block = _find(tree, where, override)
    value = typed_value(raw, _key_type(tuple(w.text for w in block.head) if block else (where[-1],), key), override)
    lines = source.split("\n")
    if block is None:  # a singleton block the file leaves to its defaults
        if not pipeline.braced and pipeline is not tree.pipelines[-1]:
            raise OverrideError(f"`--set {override}`: pipeline `{pipeline.name.text}` has no `{where[-1]}` block; "
                                f"add `{where[-1]} {{ }}` to it first")
        return _append_block(lines, pipeline, where[-1], key, value)
    entry = next((e for e in block.entries if e.key.text == key), None)
    if entry is not None:
        return _splice(lines, entry.span, f"{key} = {value}")
    brace = ast.Span(block.span.end_line, block.span.end_col - 1, block.span.end_line, block.span.end_col - 1)
    return _splice(lines, brace, f" {key} = {value} ")


def _key_type(head: tuple[str, ...], key: str):
    """The type the key holds in a block with this head (None: a key the block does not know; the
    resolver reports it where it is written)."""
    kind = head[0]
    keys = STAGE_KEYS.get(head[1], {}) if kind == "stage" and len(head) > 1 else BLOCK_KEYS.get(kind, {})
    return keys[key].type if key in keys else None


def typed_value(raw: str, key_type, override: str) -> str:
    """``raw`` as the source of one value of ``key_type``: a string key's text quoted for it (unless it is
    written as one string), otherwise exactly one value of the language, written out from its parse."""
    takes_text = isinstance(key_type, (Str, RewardFns))
    value = _one_value(raw)
    if takes_text and not isinstance(value, (ast.String, ast.ListValue)):
        return _quoted(raw)
    if value is None:
        raise OverrideError(f"`--set {override}`: `{raw}` is not one value (a number, a name, a \"string\", a "
                            "[list] or a call such as `vllm(tp = 2)`)")
    return _source_of(value)


def _one_value(raw: str) -> ast.Value | None:
    """``raw`` parsed as a single value, or None when it is not exactly one."""
    tree, _ = parse(f"set {{\nvalue = {raw}\n}}\n")  # a number past ±1e18 stays: RLP106 at the file's line
    if tree is None or tree.pipelines or len(tree.shared_blocks) != 1:
        return None
    entries = tree.shared_blocks[0].entries
    return entries[0].value if len(entries) == 1 else None


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _source_of(value: ast.Value) -> str:
    """A parsed value written back on one line: comments and layout gone, nothing but the value."""
    if isinstance(value, (ast.Number, ast.OutOfRange)):  # a number past ±1e18: RLP106 where it is written
        return value.text
    if isinstance(value, ast.String):
        return _quoted(value.value)
    if isinstance(value, ast.Name):
        return value.id
    if isinstance(value, ast.Range):
        return f"{_source_of(value.low)}..{_source_of(value.high)}"
    if isinstance(value, ast.ListValue):
        return "[" + ", ".join(_source_of(item) for item in value.items) + "]"
    if isinstance(value, ast.Call):
        args = (f"{arg.name.text} = {_source_of(arg.value)}" if arg.name else _source_of(arg.value)
                for arg in value.args)
        return f"{value.func.text}({', '.join(args)})"
    raise AssertionError(f"not a value: {value!r}")


def _find(tree: ast.SourceFile, where: list[str], override: str):
    """(the pipeline, the block or None when a singleton block is absent)."""
    *pipeline_name, target = where
    pipelines = [p for p in tree.pipelines if not pipeline_name or p.name.text == pipeline_name[0]]
    if not pipelines:
        raise OverrideError(f"`--set {override}`: no pipeline `{pipeline_name[0]}`; pipelines: "
                            + ", ".join(p.name.text for p in tree.pipelines))
    if len(pipelines) > 1 and target != "cluster":
        raise OverrideError(f"`--set {override}`: the file has several pipelines; name one first, "
                            f"`{pipelines[0].name.text}.{'.'.join(where)}.KEY=VALUE`")
    if target == "cluster":
        blocks = [b for b in tree.shared_blocks if b.kind.text == "cluster"] + \
                 [b for p in pipelines for b in p.blocks if b.kind.text == "cluster"]
        return pipelines[0], _only(blocks, override)
    blocks = pipelines[0].blocks
    named = [b for b in blocks if len(b.head) > 1 and b.head[-1].text == target]
    if named:
        return pipelines[0], _only(named, override)
    if target in SINGLETON_BLOCKS:
        return pipelines[0], next((b for b in blocks if b.kind.text == target), None)
    names = sorted({b.head[-1].text for b in blocks if len(b.head) > 1})
    close = difflib.get_close_matches(target, [*names, *SINGLETON_BLOCKS], n=1)
    raise OverrideError(f"`--set {override}`: no stage, model or dataset named `{target}` "
                        + (f"(did you mean `{close[0]}`?) " if close else "")
                        + f"(declared: {', '.join(names)}; blocks: {', '.join(SINGLETON_BLOCKS)})")


def _only(blocks: list[ast.Block], override: str) -> ast.Block:
    if len(blocks) != 1:
        raise OverrideError(f"`--set {override}`: {'no' if not blocks else 'more than one'} such block")
    return blocks[0]


def _splice(lines: list[str], span: ast.Span, text: str) -> str:
    from rldsl.compiler.fmt import replace_span

    return "\n".join(replace_span(lines, span, text))


def _append_block(lines: list[str], pipeline: ast.PipelineSyntax, kind: str, key: str, value: str) -> str:
    block = f"{kind} {{ {key} = {value} }}"
    if not pipeline.braced:
        return "\n".join(lines).rstrip("\n") + "\n" + block + "\n"
    end = pipeline.span
    brace = ast.Span(end.end_line, end.end_col - 1, end.end_line, end.end_col - 1)
    return _splice(lines, brace, f" {block} ")
