"""Diagnostics: collected, sorted by position, rendered rustc-style or as data.

A pass never raises on bad input; it returns ``Diagnostic`` values. The
renderers here are the only place that knows how a finding looks.

A finding may explain others (``Diagnostic.explains``): two pipelines on the
same GPUs without `share` make every cross-pipeline pair of non-sleeping
engines an RLP504 and the GPUs' summed memory an RLP506. ``order_by_cause``
puts such a root first and the findings it explains right after it, marked
``explained_by``; the text shows them as one line each under the root (in
full with ``verbose``), JSON in full. Nothing is dropped and everything is
counted: a folded error still fails `check`.
"""


from typing import Iterable, NamedTuple, Sequence

ERROR = "error"
WARNING = "warning"

JSON_SCHEMA_VERSION = 1


class Span(NamedTuple):
    """A region of the source, 1-based lines and columns, end exclusive;
    ordered by position (a tuple)."""

    line: int
    col: int
    end_line: int
    end_col: int

    @staticmethod
    def point(line: int, col: int) -> "Span":
        return Span(line, col, line, col + 1)


NO_SPAN = Span(1, 1, 1, 1)


class Consequence(NamedTuple):
    """A finding a root explains: the one of ``code`` at ``span`` (and about
    ``subject`` when given, for a rule that reports several things at one span)."""

    code: str
    span: Span
    subject: str = ""


class Diagnostic(NamedTuple):
    code: str
    severity: str
    message: str
    span: Span
    help: str | None = None
    notes: tuple[str, ...] = ()
    # Secondary places worth showing (for example where a name was first declared).
    related: tuple[tuple[Span, str], ...] = ()
    # A mechanical fix (`rldsl fmt --fix` applies it): this span's text becomes this text.
    edit: tuple[Span, str] | None = None
    # What the finding is about, as a root names it in a Consequence (a stage pair, a GPU).
    subject: str = ""
    explains: tuple[Consequence, ...] = ()
    # Set by order_by_cause: the root (its code and span) this finding follows from.
    explained_by: tuple[str, Span] | None = None

    @property
    def is_error(self) -> bool:
        return self.severity == ERROR


def sort_diagnostics(diags: Iterable[Diagnostic]) -> list[Diagnostic]:
    unique = {(d.span, d.code, d.message): d for d in diags}
    return sorted(unique.values(), key=lambda d: (d.span, d.code, d.message))


def _claimed(root: Diagnostic, d: Diagnostic) -> bool:
    return d is not root and any(c.code == d.code and c.span == d.span and c.subject in ("", d.subject)
                                 for c in root.explains)


def order_by_cause(diags: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Roots first, each followed by the findings it explains (``explained_by``
    set, under the outermost root when explanations chain); then every other
    finding by position. The same findings, reordered: none is dropped."""
    ordered = sort_diagnostics(diags)
    parent: dict[int, int] = {}
    for r, root in enumerate(ordered):
        for i, d in enumerate(ordered):
            if i not in parent and _claimed(root, d) and not _descends(r, i, parent):
                parent[i] = r
    top = {i: _outermost(i, parent) for i in parent}
    roots = sorted(set(top.values()))
    out = []
    for r in roots:
        root = ordered[r]
        out.append(root)
        out += [ordered[i]._replace(explained_by=(root.code, root.span)) for i in sorted(top) if top[i] == r]
    return out + [d for i, d in enumerate(ordered) if i not in parent and i not in roots]


def _descends(index: int, ancestor: int, parent: dict[int, int]) -> bool:
    while index in parent:
        index = parent[index]
        if index == ancestor:
            return True
    return index == ancestor


def _outermost(index: int, parent: dict[int, int]) -> int:
    while index in parent:
        index = parent[index]
    return index


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    """The help line for a near miss, or None when nothing is close."""
    import difflib  # only when a name is wrong: keeps `check` start-up small

    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else None


# --------------------------------------------------------------- rendering


class _Style:
    def __init__(self, color: bool):
        self.color = color

    def __call__(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text


def render_text(diags: Sequence[Diagnostic], source: str, filename: str, color: bool = False,
                verbose: bool = False) -> str:
    """rustc-like text: header, location arrow, the line as written, carets.
    A finding another one explains is a line under that root, or with
    ``verbose`` a finding of its own that names its root."""
    style = _Style(color)
    lines = source_lines(source)
    out: list[str] = []
    for d in diags:
        if d.explained_by and not verbose:
            continue
        sev_color = "1;31" if d.is_error else "1;33"
        out.append(style(f"{d.severity}[{d.code}]", sev_color) + style(f": {d.message}", "1"))
        out.extend(_render_snippet(d.span, lines, filename, style, sev_color))
        for span, label in d.related:
            out.extend(_render_snippet(span, lines, filename, style, "1;34", label=label))
        for note in d.notes:
            out.append(style("  = note", "1;34") + f": {note}")
        if d.explained_by:
            code, span = d.explained_by
            out.append(style("  = note", "1;34") + f": follows from [{code}] at {filename}:{span.line}:{span.col}")
        if d.help:
            out.append(style("  = help", "1;36") + f": {d.help}")
        out.extend(_folded(d, diags, filename, style, verbose))
        out.append("")
    out.append(summary_line(diags))
    return "\n".join(out) + "\n"


def _folded(root: Diagnostic, diags: Sequence[Diagnostic], filename: str, style: "_Style", verbose: bool) -> list[str]:
    """The findings ``root`` explains, one line each: fix the root and they go too."""
    explained = [d for d in diags if d.explained_by == (root.code, root.span)]
    if not explained:
        return []
    where = "below" if verbose else "in full with `--verbose`"
    out = [style("  = explains", "1;34") + f": {len(explained)} finding{'s' * (len(explained) != 1)} that follow "
           f"from it ({where}):"]
    out += [f"      {d.severity}[{d.code}] {filename}:{d.span.line}:{d.span.col}: {d.message}" for d in explained]
    return out


def source_lines(source: str) -> list[str]:
    """The one line model positions use too: lines end at a newline only (a
    form feed or a Unicode line separator is a character within its line),
    and a carriage return before the newline is not shown."""
    return [line.removesuffix("\r") for line in source.split("\n")]


SNIPPET_WIDTH = 120  # a longer line is shown as a window around the caret


def _render_snippet(span: Span, lines: list[str], filename: str, style: _Style, color: str,
                    label: str = "") -> list[str]:
    gutter = " " * len(str(span.line))
    out = [f"{gutter}{style('-->', '1;34')} {filename}:{span.line}:{span.col}"]
    if not 1 <= span.line <= len(lines):
        return out
    text = _printable(lines[span.line - 1])
    end = span.end_col if span.end_line == span.line else len(text) + 1
    width = max(1, min(end, len(text) + 1) - span.col)
    text, col, width = _window(text, span.col, width)
    carets = " " * (col - 1) + "^" * width
    out.append(f"{gutter} {style('|', '1;34')}")
    out.append(f"{style(str(span.line), '1;34')} {style('|', '1;34')} {text}")
    out.append(f"{gutter} {style('|', '1;34')} {style(carets, color)}{(' ' + label) if label else ''}")
    return out


def _printable(text: str) -> str:
    """One display column per character: tabs and other control or separator
    characters become spaces, so the carets stay under what they mark."""
    return "".join(" " if not char.isprintable() else char for char in text)


def _window(text: str, col: int, width: int) -> tuple[str, int, int]:
    """At most SNIPPET_WIDTH characters of ``text`` around columns col..col+width."""
    if len(text) <= SNIPPET_WIDTH:
        return text, col, width
    width = min(width, SNIPPET_WIDTH // 2)
    start = max(0, min(col - 1 - SNIPPET_WIDTH // 3, len(text) - SNIPPET_WIDTH))
    shown = text[start:start + SNIPPET_WIDTH]
    prefix = "…" if start > 0 else ""
    suffix = "…" if start + SNIPPET_WIDTH < len(text) else ""
    return prefix + shown + suffix, col - start + len(prefix), width


def summary_line(diags: Sequence[Diagnostic]) -> str:
    errors = sum(d.is_error for d in diags)
    warnings = len(diags) - errors
    if not diags:
        return "ok: no findings"
    explained = sum(bool(d.explained_by) for d in diags)
    folded = f" ({explained} of them explained by another finding)" if explained else ""
    return f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}{folded}"


def to_json(diags: Sequence[Diagnostic], filename: str) -> dict:
    """A versioned, stable shape (terraform validate -json style)."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "file": filename,
        "valid": not any(d.is_error for d in diags),
        "error_count": sum(d.is_error for d in diags),
        "warning_count": sum(not d.is_error for d in diags),
        "diagnostics": [
            {
                "code": d.code,
                "severity": d.severity,
                "message": d.message,
                "help": d.help,
                "notes": list(d.notes),
                "range": _range(d.span),
                "related": [{"range": _range(s), "message": m} for s, m in d.related],
                "explained_by": {"code": d.explained_by[0], "range": _range(d.explained_by[1])}
                if d.explained_by else None,
            }
            for d in diags
        ],
    }


def _range(span: Span) -> dict:
    return {
        "start": {"line": span.line, "column": span.col},
        "end": {"line": span.end_line, "column": span.end_col},
    }


def to_sarif(diags: Sequence[Diagnostic], filename: str, rules: dict[str, str]) -> dict:
    """SARIF 2.1.0, one run, the rules that fired listed in the driver."""
    fired = sorted({d.code for d in diags})
    return {
        "version": "2.1.0",
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "rldsl",
                        "informationUri": "https://github.com/rldsl/rldsl",
                        "rules": [{"id": c, "shortDescription": {"text": rules.get(c, c)}} for c in fired],
                    }
                },
                "results": [
                    {
                        "ruleId": d.code,
                        "level": "error" if d.is_error else "warning",
                        "message": {"text": d.message + (f" (help: {d.help})" if d.help else "")
                                    + (f" (follows from {d.explained_by[0]} at line {d.explained_by[1].line})"
                                       if d.explained_by else "")},
                        "locations": [
                            {
                                "physicalLocation": {
                                    "artifactLocation": {"uri": filename},
                                    "region": {
                                        "startLine": d.span.line,
                                        "startColumn": d.span.col,
                                        "endLine": d.span.end_line,
                                        "endColumn": d.span.end_col,
                                    },
                                }
                            }
                        ],
                    }
                    for d in diags
                ],
            }
        ],
    }
