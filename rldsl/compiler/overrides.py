"""`--set TARGET.KEY=VALUE`: a setting changed from the command line.

The override is written into the source text, then the text is checked
like any file: a wrong value is the same finding it would be in the file,
and the plan is the plan of the file as overridden. TARGET names a block
the way a file does: a stage, model or dataset by its name, or a
singleton block by its kind (`run`, `staleness`, `buffer`, `placement`,
`cluster`); with several pipelines, `PIPELINE.TARGET.KEY`.

Edits keep every line where it was (a key added to a block goes before
its closing brace, on that line; a missing singleton block goes at the
end), so every finding's line number is the file's own.
"""

from __future__ import annotations

from rldsl.compiler import ast
from rldsl.compiler.parser import parse

SINGLETON_BLOCKS = ("run", "staleness", "buffer", "placement", "cluster")


class OverrideError(ValueError):
    """An override that names nothing, or is not written `TARGET.KEY=VALUE`."""


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
    if not equals or not value.strip() or len(path) not in (2, 3) or not all(path):
        raise OverrideError(f"`--set {override}`: write TARGET.KEY=VALUE (for example `actor.lr=1e-5`, "
                            "`run.steps=100`; with several pipelines PIPELINE.TARGET.KEY=VALUE)")
    return path, value.strip()


def _apply(source: str, tree: ast.SourceFile, path: list[str], value: str, override: str) -> str:
    *where, key = path
    pipeline, block = _find(tree, where, override)
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
    raise OverrideError(f"`--set {override}`: no stage, model or dataset named `{target}` (declared: "
                        f"{', '.join(names)}; blocks: {', '.join(SINGLETON_BLOCKS)})")


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
