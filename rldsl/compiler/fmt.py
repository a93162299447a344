"""`rldsl fmt`: a file rewritten to the current language, comments kept.

Two things change, and nothing else: every renamed setting (RLP109) is
written under its new name, by the edit its warning carries, and the
layout is made regular without touching a token: line ends `\\n`, no
trailing spaces, tabs at the start of a line as two spaces, at most one
blank line in a row, one newline at the end. Applying it twice gives the
same text (the tests check), so `fmt` can run in CI as a check.
"""

from __future__ import annotations

import re

from rldsl.compiler.diagnostics import Diagnostic, Span

RENAMED = "RLP109"


def format_source(source: str, diagnostics: list[Diagnostic]) -> tuple[str, int]:
    """``(text, renamed)``: ``source`` with the edits of ``diagnostics`` applied
    and its layout made regular; ``renamed``: how many edits were applied."""
    # only renames: other rules' edits change what the pipeline does, which `fmt` never does
    edits = sorted((d.edit for d in diagnostics if d.edit is not None and d.code == RENAMED), reverse=True)
    text = _normalise_line_ends(source)
    lines = text.split("\n")
    for span, replacement in edits:  # from the last, so earlier spans stay where they are
        lines = replace_span(lines, span, replacement)
    return _regular_layout("\n".join(lines)), len(edits)


def _normalise_line_ends(text: str) -> str:
    return text.replace("\r\n", "\n")


def replace_span(lines: list[str], span: Span, replacement: str) -> list[str]:
    """``lines`` with the text under ``span`` (1-based, end exclusive) replaced."""
    first, last = lines[span.line - 1], lines[span.end_line - 1]
    joined = first[: span.col - 1] + replacement + last[span.end_col - 1:]
    return lines[: span.line - 1] + joined.split("\n") + lines[span.end_line:]


def _regular_layout(text: str) -> str:
    lines = [_leading_tabs(line.rstrip()) for line in text.split("\n")]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip("\n") + "\n"


def _leading_tabs(line: str) -> str:
    indent = re.match(r"[ \t]*", line).group(0)
    return indent.replace("\t", "  ") + line[len(indent):]
