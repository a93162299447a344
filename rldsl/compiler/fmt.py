"""`rldsl fmt`: a file rewritten to the current language, comments kept.

Two things change, and nothing else: every old form the compiler reads
with its old meaning is written in the current one, by the edit its
warning carries (a renamed setting, RLP109; the other old meanings kept,
rldsl.compiler.old_meanings.KEPT_MEANINGS: a colocated policy scorer
added to the trainer's sync, a `share` between pipelines, logprob forwards
cut to fit), so the plan is the same before and after; and the layout is
made regular without touching a token: line ends `\\n`, no trailing
spaces, tabs at the start of a line as two spaces, at most one blank line
in a row, one newline at the end. Applying it twice gives the same text
(the tests check), so `fmt` can run in CI as a check.
"""

from __future__ import annotations

import re
from collections import Counter

from rldsl.compiler.diagnostics import Diagnostic, Span
from rldsl.compiler.old_meanings import KEPT_MEANINGS

RENAMED = "RLP109"


def format_source(source: str, diagnostics: list[Diagnostic]) -> tuple[str, int]:
    """``(text, rewritten)``: ``source`` with the edits of ``diagnostics`` that
    keep its meaning applied and its layout made regular; ``rewritten``: how
    many edits were applied."""
    text, applied = format_source_by_code(source, diagnostics)
    return text, sum(applied.values())


def format_source_by_code(source: str, diagnostics: list[Diagnostic]) -> tuple[str, Counter]:
    """As ``format_source``, with the edits applied counted per code."""
    # only old meanings: other rules' edits change what the pipeline does, which `fmt` never does
    kept = {(d.edit, d.code) for d in diagnostics if d.edit is not None and d.code in KEPT_MEANINGS}
    lines, applied, after = _normalise_line_ends(source).split("\n"), Counter(), None
    for (span, replacement), code in sorted(kept, reverse=True):  # from the last: earlier spans stay put
        if after is not None and (span.end_line, span.end_col) > (after.line, after.col):
            continue  # overlaps an edit made: the next `fmt` run makes it on the new text
        lines = replace_span(lines, span, replacement)
        applied[code] += 1
        after = span
    return _regular_layout("\n".join(lines)), applied


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
