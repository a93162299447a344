"""The syntax tree: frozen dataclasses, every node with its source span.

The tree says only what was written; meaning (which keys exist, what a name
refers to, units) is the resolver's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from rldsl.compiler.diagnostics import Span


@dataclass(frozen=True)
class Word:
    text: str
    span: Span


@dataclass(frozen=True)
class Number:
    text: str  # as written, for messages
    magnitude: float
    is_integer: bool
    unit: str  # "" when none
    span: Span


@dataclass(frozen=True)
class String:
    value: str
    span: Span


@dataclass(frozen=True)
class Name:
    id: str
    span: Span


@dataclass(frozen=True)
class Range:
    low: Number
    high: Number
    span: Span


@dataclass(frozen=True)
class ListValue:
    items: tuple["Value", ...]
    span: Span


@dataclass(frozen=True)
class Arg:
    name: Word | None  # None for a positional argument
    value: "Value"
    span: Span


@dataclass(frozen=True)
class Call:
    func: Word
    args: tuple[Arg, ...]
    span: Span


Value = Union[Number, String, Name, Range, ListValue, Call]


@dataclass(frozen=True)
class Entry:
    key: Word
    value: Value | None  # None for a bare flag such as `frozen`
    span: Span


@dataclass(frozen=True)
class Block:
    """`stage train actor { ... }`: head words, then entries."""

    head: tuple[Word, ...]
    entries: tuple[Entry, ...]
    span: Span

    @property
    def kind(self) -> Word:
        return self.head[0]


@dataclass(frozen=True)
class Flow:
    """`flow a -> [b, c] -> d`: each hop is one or more stage names."""

    hops: tuple[tuple[Word, ...], ...]
    span: Span


@dataclass(frozen=True)
class PipelineSyntax:
    name: Word
    blocks: tuple[Block, ...]
    flows: tuple[Flow, ...]
    span: Span
    braced: bool  # `pipeline x { ... }` rather than a `pipeline x` header


@dataclass(frozen=True)
class SourceFile:
    """A whole file: the pipelines and the blocks they share (the cluster)."""

    pipelines: tuple[PipelineSyntax, ...]
    shared_blocks: tuple[Block, ...]
