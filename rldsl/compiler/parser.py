"""Text -> syntax tree. A malformed file yields a diagnostic, never a traceback."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from rldsl.compiler import ast
from rldsl.compiler.diagnostics import ERROR, Diagnostic, Span

GRAMMAR = Path(__file__).with_name("grammar.lark")

_TERMINAL_WORDS = {
    "NAME": "a name",
    "NUMBER": "a number",
    "STRING": "a string",
    "LBRACE": "`{`",
    "RBRACE": "`}`",
    "LSQB": "`[`",
    "RSQB": "`]`",
    "LPAR": "`(`",
    "RPAR": "`)`",
    "EQUAL": "`=`",
    "COMMA": "`,`",
    "__ANON_0": "`->`",
    "__ANON_1": "`..`",
    "PIPELINE": "`pipeline`",
    "FLOW": "`flow`",
    "$END": "end of file",
}


@lru_cache(maxsize=1)
def _lark() -> Lark:
    # cache=True keeps the LALR tables on disk: check must start fast.
    return Lark.open(str(GRAMMAR), parser="lalr", propagate_positions=True, cache=True)


class ParseFailure(Exception):
    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


MAX_NESTING = 32  # brackets inside brackets; far beyond any pipeline, far below Python's recursion limit
BYTE_ORDER_MARK = "\ufeff"  # a UTF-8 file may start with one: it is no part of the pipeline
MAX_LINE_CHARS = 20_000  # a list of a thousand GPU ids fits; lark's lexer takes seconds on megabyte lines


def parse(text: str) -> tuple[ast.SourceFile | None, list[Diagnostic]]:
    """Parse a whole file. Returns the tree or the syntax diagnostics."""
    if text.startswith(BYTE_ORDER_MARK):  # editors on Windows write one; a space keeps every column where it is
        text = " " + text[1:]
    too_long = _line_length_diagnostic(text)
    if too_long is not None:  # refuse before the lexer walks it
        return None, [too_long]
    too_deep = _nesting_diagnostic(text)
    if too_deep is not None:  # the tree builders recurse per level: refuse before they do
        return None, [too_deep]
    try:
        tree = _lark().parse(text)
        builder = _ToAst()
        return builder.transform(tree), builder.out_of_range
    except UnexpectedInput as err:
        return None, [_syntax_diagnostic(err, text)]
    except VisitError as err:  # a structural error raised while building the tree
        inner = err.orig_exc
        if isinstance(inner, ParseFailure):
            return None, [inner.diagnostic]
        raise


# ------------------------------------------------------------------ errors


_OPENING = "([{"
_SIGNIFICANT = re.compile(r'[\[\](){}"#\n]')
_STRING = re.compile(r'"([^"\\\n]|\\.)*"')  # the grammar's STRING


def _line_length_diagnostic(text: str) -> Diagnostic | None:
    """RLP003 on the first line longer than MAX_LINE_CHARS (lines end at
    `\\n` only, as positions count them), or None."""
    if len(text) <= MAX_LINE_CHARS:
        return None  # every file written by hand
    start, line = 0, 1
    while True:
        end = text.find("\n", start)
        stop = len(text) if end < 0 else end
        if stop - start > MAX_LINE_CHARS:
            column = MAX_LINE_CHARS + 1
            return Diagnostic("RLP003", ERROR, f"a line of {stop - start:,} characters (at most {MAX_LINE_CHARS:,})",
                              Span(line, column, line, column + 1),
                              help="break it: values may span lines, so wrap a long list after any comma")
        if end < 0:
            return None
        start, line = end + 1, line + 1


def _nesting_diagnostic(text: str) -> Diagnostic | None:
    """RLP002 at the first bracket that opens level MAX_NESTING + 1 (strings
    and comments skipped), or None. Jumps from one bracket, quote, comment
    or newline to the next: linear, and fast on a megabyte-long line."""
    if sum(text.count(bracket) for bracket in _OPENING) <= MAX_NESTING:
        return None  # every file written by hand
    depth, line, line_start, index = 0, 1, 0, 0
    while True:
        found = _SIGNIFICANT.search(text, index)
        if found is None:
            return None
        index, char = found.start(), found.group()
        if char == "\n":
            line, line_start = line + 1, index + 1
        elif char == "#":  # a comment runs to the end of its line
            end = text.find("\n", index)
            index = len(text) if end < 0 else end
            continue
        elif char == '"':  # a string (escapes allowed) ends at its closing quote on the same line
            match = _STRING.match(text, index)
            index = match.end() if match else index + 1
            continue
        elif char in _OPENING:
            depth += 1
            if depth > MAX_NESTING:
                col = index - line_start + 1
                return Diagnostic("RLP002", ERROR, f"brackets nested deeper than {MAX_NESTING} levels",
                                  Span(line, col, line, col + 1),
                                  help=f"no pipeline value needs more than a few levels; keep lists, calls and "
                                       f"blocks within {MAX_NESTING}")
        else:
            depth = max(0, depth - 1)
        index += 1


def _syntax_diagnostic(err: UnexpectedInput, text: str) -> Diagnostic:
    line, col = max(1, err.line or 1), max(1, err.column or 1)
    if isinstance(err, UnexpectedCharacters):
        char = text[err.pos_in_stream] if err.pos_in_stream < len(text) else ""
        if char == '"':
            return Diagnostic("RLP001", ERROR, "unterminated string", Span(line, col, line, col + 1),
                              help='close the string with `"` on the same line')
        return Diagnostic("RLP001", ERROR, f"unexpected character `{char}`", Span(line, col, line, col + 1),
                          help="values are numbers, \"strings\", names, [lists], ranges `0..3` and calls `vllm(tp = 2)`")
    expected = _expected_words(err)
    if isinstance(err, UnexpectedEOF) or (isinstance(err, UnexpectedToken) and err.token.type == "$END"):
        return _eof_diagnostic(text, expected)
    token: Token = err.token
    width = max(1, len(str(token)))
    message = f"unexpected {_describe(token)}"
    help_text = f"expected {expected}" if expected else "this does not fit here: check the text just before it"
    if token.type == "NUMBER" and "`=`" in (expected or ""):
        help_text = "write `key = value`: the `=` is missing"
    return Diagnostic("RLP001", ERROR, message, Span(line, col, line, col + width), help=help_text)


def _eof_diagnostic(text: str, expected: str | None) -> Diagnostic:
    lines = text.splitlines() or [""]
    end = Span(len(lines), len(lines[-1]) + 1, len(lines), len(lines[-1]) + 2)
    opener = _last_unclosed_brace(text)
    if opener is not None:
        return Diagnostic("RLP001", ERROR, "this `{` is never closed", opener,
                          help="add the matching `}` at the end of the block")
    return Diagnostic("RLP001", ERROR, "unexpected end of file", end,
                      help=f"expected {expected}" if expected else "the file ends inside a declaration: finish it")


def _last_unclosed_brace(text: str) -> Span | None:
    stack: list[Span] = []
    code = re.sub(r'"([^"\\\n]|\\.)*"|#[^\n]*', lambda m: " " * len(m.group(0)), text)
    for lineno, line in enumerate(code.splitlines(), start=1):
        for col, ch in enumerate(line, start=1):
            if ch == "{":
                stack.append(Span(lineno, col, lineno, col + 1))
            elif ch == "}" and stack:
                stack.pop()
    return stack[-1] if stack else None


def _expected_words(err: UnexpectedInput) -> str | None:
    names = getattr(err, "accepts", None) or getattr(err, "expected", None) or set()
    words = sorted({_TERMINAL_WORDS.get(n, f"`{n.lower()}`") for n in names})
    if not words:
        return None
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _describe(token: Token) -> str:
    kinds = {"NAME": "name", "NUMBER": "number", "STRING": "string"}
    return f"{kinds[token.type]} `{token}`" if token.type in kinds else f"`{token}`"


# -------------------------------------------------------------- tree -> AST


def _span(meta) -> Span:
    return Span(meta.line, meta.column, meta.end_line, meta.end_column)


def _tok_span(tok: Token) -> Span:
    return Span(tok.line, tok.column, tok.end_line, tok.end_column)


def _word(tok: Token) -> ast.Word:
    return ast.Word(str(tok), _tok_span(tok))


_NUMBER = re.compile(r"(-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)([A-Za-z%]*)$")


MAX_MAGNITUDE = 1e18  # no setting needs more (a TiB is 1.1e12 bytes); beyond, floats lose whole numbers


def number_from_token(tok: Token) -> ast.Number | ast.OutOfRange:
    digits, unit = _NUMBER.match(str(tok)).groups()
    is_int = re.fullmatch(r"-?[0-9]+", digits) is not None
    # "1e-3" has no unit: the exponent was consumed by the digits group.
    magnitude = float(digits)
    if not abs(magnitude) <= MAX_MAGNITUDE:  # also catches inf and nan
        return ast.OutOfRange(str(tok), _tok_span(tok))
    return ast.Number(str(tok), magnitude, is_int, unit, _tok_span(tok))


def out_of_range_diagnostic(number: ast.OutOfRange) -> Diagnostic:
    """RLP106 for a number past ±1e18: one finding; its key is left invalid, nothing else is hidden."""
    shown = number.text if len(number.text) <= 24 else f"{number.text[:20]}…"
    return Diagnostic("RLP106", ERROR, f"`{shown}` is too large: numbers stay within ±1e18", number.span,
                      help="write the value the setting needs; sizes take units (`256MiB`, `7B`), durations too "
                           "(`30s`)")


@v_args(meta=True)
class _ToAst(Transformer):
    def __init__(self):
        super().__init__()
        self.out_of_range: list[Diagnostic] = []  # RLP106 for each number past ±1e18, in file order

    def _number(self, tok: Token) -> ast.Number | ast.OutOfRange:
        number = number_from_token(tok)
        if isinstance(number, ast.OutOfRange):
            self.out_of_range.append(out_of_range_diagnostic(number))
        return number

    def start(self, meta, items):
        headers = [i for i in items if isinstance(i, _Header)]
        braced = [i for i in items if isinstance(i, ast.PipelineSyntax)]
        blocks = [i for i in items if isinstance(i, ast.Block)]
        flows = [i for i in items if isinstance(i, ast.Flow)]
        if headers and braced:
            raise ParseFailure(Diagnostic("RLP001", ERROR, "a file uses either one `pipeline NAME` header or `pipeline NAME { ... }` blocks, not both",
                                          headers[0].word.span, help="wrap each pipeline's declarations in `pipeline NAME { ... }`"))
        if len(headers) > 1:
            raise ParseFailure(Diagnostic("RLP001", ERROR, "a second `pipeline` header", headers[1].word.span,
                                          help="several pipelines in one file are written `pipeline NAME { ... }`"))
        if headers:
            shared = tuple(b for b in blocks if b.kind.text == "cluster")
            own = tuple(b for b in blocks if b.kind.text != "cluster")
            end = _last_span(items)
            span = Span(headers[0].span.line, headers[0].span.col, end.end_line, end.end_col)
            pipe = ast.PipelineSyntax(headers[0].word, own, tuple(flows), span, braced=False)
            return ast.SourceFile((pipe,), shared)
        if flows:
            raise ParseFailure(Diagnostic("RLP001", ERROR, "a `flow` outside any pipeline", flows[0].span,
                                          help="move it inside its `pipeline NAME { ... }` block"))
        return ast.SourceFile(tuple(braced), tuple(blocks))

    def pipeline_header(self, meta, items):
        return _Header(_word(items[0]), _span(meta))

    def pipeline_block(self, meta, items):
        name, *body = items
        blocks = tuple(b for b in body if isinstance(b, ast.Block))
        flows = tuple(f for f in body if isinstance(f, ast.Flow))
        return ast.PipelineSyntax(_word(name), blocks, flows, _span(meta), braced=True)

    def block(self, meta, items):
        head = tuple(_word(t) for t in items if isinstance(t, Token))
        entries = tuple(e for e in items if isinstance(e, ast.Entry))
        return ast.Block(head, entries, _span(meta))

    def assign(self, meta, items):
        return ast.Entry(_word(items[0]), items[1], _span(meta))

    def flag(self, meta, items):
        return ast.Entry(_word(items[0]), None, _span(meta))

    def flow(self, meta, items):
        hops = tuple(i if isinstance(i, tuple) else (_word(i),) for i in items)
        return ast.Flow(hops, _span(meta))

    def fan(self, meta, items):
        return tuple(_word(t) for t in items)

    def number(self, meta, items):
        return self._number(items[0])

    def string(self, meta, items):
        raw = str(items[0])[1:-1]
        return ast.String(re.sub(r"\\(.)", r"\1", raw), _span(meta))

    def name(self, meta, items):
        return ast.Name(str(items[0]), _span(meta))

    def range(self, meta, items):
        return ast.Range(self._number(items[0]), self._number(items[1]), _span(meta))

    def list(self, meta, items):
        return ast.ListValue(tuple(i for i in items if i is not None), _span(meta))

    def call(self, meta, items):
        func, *args = items
        return ast.Call(_word(func), tuple(a for a in args if a is not None), _span(meta))

    def kwarg(self, meta, items):
        return ast.Arg(_word(items[0]), items[1], _span(meta))

    def posarg(self, meta, items):
        return ast.Arg(None, items[0], _span(meta))


class _Header:
    def __init__(self, word: ast.Word, span: Span):
        self.word, self.span = word, span


def _last_span(items) -> Span:
    spans = [i.span for i in items if hasattr(i, "span")]
    return max(spans, key=lambda s: (s.end_line, s.end_col)) if spans else Span(1, 1, 1, 1)
