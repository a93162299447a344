"""The syntax tree: immutable nodes, every one with its source span.

The tree says only what was written; meaning (which keys exist, what a name
refers to, units) is the resolver's job. Nodes are NamedTuples: immutable,
and about five times cheaper than frozen dataclasses to define at import,
which `rldsl check` pays on every start.
"""


from typing import NamedTuple, Union

from rldsl.compiler.diagnostics import Span


class Word(NamedTuple):
    text: str
    span: Span


class Number(NamedTuple):
    text: str  # as written, for messages
    magnitude: float
    is_integer: bool
    unit: str  # "" when none
    span: Span


class String(NamedTuple):
    value: str
    span: Span


class Name(NamedTuple):
    id: str
    span: Span


class Range(NamedTuple):
    low: "Number | OutOfRange"
    high: "Number | OutOfRange"
    span: Span


class ListValue(NamedTuple):
    items: tuple["Value", ...]
    span: Span


class Arg(NamedTuple):
    name: Word | None  # None for a positional argument
    value: "Value"
    span: Span


class Call(NamedTuple):
    func: Word
    args: tuple[Arg, ...]
    span: Span


class OutOfRange(NamedTuple):
    """A number past ±1e18 (RLP106, reported by the parser): the key holding
    it is invalid, and every other finding of the file is still made."""

    text: str
    span: Span


Value = Union[Number, String, Name, Range, ListValue, Call, OutOfRange]


class Entry(NamedTuple):
    key: Word
    value: Value | None  # None for a bare flag such as `frozen`
    span: Span


class Block(NamedTuple):
    """`stage train actor { ... }`: head words, then entries."""

    head: tuple[Word, ...]
    entries: tuple[Entry, ...]
    span: Span

    @property
    def kind(self) -> Word:
        return self.head[0]


class Flow(NamedTuple):
    """`flow a -> [b, c] -> d`: each hop is one or more stage names."""

    hops: tuple[tuple[Word, ...], ...]
    span: Span


class PipelineSyntax(NamedTuple):
    name: Word
    blocks: tuple[Block, ...]
    flows: tuple[Flow, ...]
    span: Span
    braced: bool  # `pipeline x { ... }` rather than a `pipeline x` header


class SourceFile(NamedTuple):
    """A whole file: the pipelines and the blocks they share (the cluster)."""

    pipelines: tuple[PipelineSyntax, ...]
    shared_blocks: tuple[Block, ...]
