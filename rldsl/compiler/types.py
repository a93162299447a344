"""Value types of the language: each converts a syntax value or reports why not.

Type specs are plain classes, not dataclasses: building a dataclass costs about
a millisecond at import, and `rldsl check` must start fast.

A type is a small object with ``convert(value) -> (python value | INVALID,
diagnostics)`` and a ``describe`` used in messages and the reference docs.
"""


import re
from collections import Counter
from typing import Any, Callable, NamedTuple

from rldsl.compiler import ast
from rldsl.compiler.diagnostics import ERROR, WARNING, Diagnostic, Span, did_you_mean
from rldsl.compiler.renames import RenamedArgument, renamed_argument
from rldsl.compiler.units import COUNT_UNITS, DURATION_UNITS, PERCENT_UNITS, SIZE_UNITS

INVALID = object()
Result = tuple[Any, list[Diagnostic]]


def _err(code: str, message: str, span: Span, help: str) -> list[Diagnostic]:
    return [Diagnostic(code, ERROR, message, span, help=help)]


def _kind_of(value: ast.Value) -> str:
    return {
        ast.Number: "a number", ast.String: "a string", ast.Name: "a name",
        ast.Range: "a range", ast.ListValue: "a list", ast.Call: "a call",
    }[type(value)]


def _shown(value: ast.Value) -> str:
    if isinstance(value, ast.Number):
        return f"`{value.text}`"
    if isinstance(value, ast.String):
        return f'`"{value.value}"`'
    if isinstance(value, ast.Name):
        return f"`{value.id}`"
    return _kind_of(value)


def mismatch(expected: str, value: ast.Value, help: str | None = None) -> Result:
    quoted = isinstance(value, ast.String) and "string" not in expected
    help = help or f"write {expected}" + (", without quotes" if quoted else "")
    return INVALID, _err("RLP104", f"expected {expected}, found {_shown(value)}", value.span, help)


class Ref(NamedTuple):
    """A name that refers to another declaration; bound by the resolver."""

    name: str
    span: Span


class EngineSpec(NamedTuple):
    name: str
    args: dict
    span: Span
    arg_spans: dict | None = None  # argument -> the span of its `name = value`
    name_span: Span | None = None  # the engine's name as written


class GpuRequest(NamedTuple):
    """`gpus = 2` (a count, placed automatically) or `gpus = [0..1, 4]` (ids)."""

    count: int
    ids: tuple[int, ...] | None
    span: Span


class LossSpec(NamedTuple):
    name: str
    args: dict
    span: Span
    arg_spans: dict | None = None


def arg_span(spec: EngineSpec | LossSpec, arg: str) -> Span:
    """Where one argument of an engine or loss call was written: its
    `name = value`; the call's span when it was left out (a default)."""
    return (spec.arg_spans or {}).get(arg, spec.span)


# ------------------------------------------------------------------ scalars


class Int:
    def __init__(self, low: int | None = None, high: int | None = None, describe: str = "an integer"):
        self.low, self.high, self.describe = low, high, describe

    def convert(self, value: ast.Value) -> Result:
        if not isinstance(value, ast.Number) or not value.is_integer or value.unit:
            help = "counts are whole numbers without units" if isinstance(value, ast.Number) else None
            return mismatch(self.describe, value, help)
        return _in_range(int(value.magnitude), self.low, self.high, value)


class Float:
    def __init__(self, low: float | None = None, high: float | None = None, describe: str = "a number"):
        self.low, self.high, self.describe = low, high, describe

    def convert(self, value: ast.Value) -> Result:
        if not isinstance(value, ast.Number) or value.unit:
            return mismatch(self.describe, value)
        return _in_range(value.magnitude, self.low, self.high, value)


def _in_range(number, low, high, value: ast.Number) -> Result:
    if (low is not None and number < low) or (high is not None and number > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}" if low is not None else f"at most {high}"
        return INVALID, _err("RLP106", f"`{value.text}` is out of range: must be {bounds}", value.span,
                             "write a value " + ("" if bounds.startswith("between") else "of ") + bounds)
    return number, []


class Bool:
    describe = "`true` or `false`"

    def convert(self, value: ast.Value) -> Result:
        if isinstance(value, ast.Name) and value.id in ("true", "false"):
            return value.id == "true", []
        return mismatch(self.describe, value)


class SleepLevel:
    """vLLM's sleep: `false` (0, never sleeps), `true` or `1` (weights to host
    memory), `2` (weights discarded). Converts to the level, an integer."""

    describe = "`true`, `false`, `1` or `2`"

    def convert(self, value: ast.Value) -> Result:
        if isinstance(value, ast.Name) and value.id in ("true", "false"):
            return int(value.id == "true"), []
        if isinstance(value, ast.Number) and value.is_integer and not value.unit:
            if value.magnitude in (0, 1, 2):
                return int(value.magnitude), []
            return INVALID, _err("RLP106", f"sleep level `{value.text}` is out of range: must be 0, 1 or 2",
                                 value.span, "1 (or `true`) keeps the weights in host memory, 2 discards them")
        return mismatch(self.describe, value, "1 (or `true`) keeps the weights in host memory, 2 discards them")


class Str:
    def __init__(self, pattern: str | None = None, describe: str = "a string", hint: str | None = None):
        self.pattern, self.describe, self.hint = pattern, describe, hint

    def convert(self, value: ast.Value) -> Result:
        if not isinstance(value, ast.String):
            help = f'quote it: "{value.id}"' if isinstance(value, ast.Name) else self.hint
            return mismatch(self.describe, value, help)
        if self.pattern and not re.fullmatch(self.pattern, value.value):
            return INVALID, _err("RLP104", f'`"{value.value}"` is not {self.describe}', value.span,
                                 self.hint or f"write {self.describe}")
        return value.value, []


class Enum:
    def __init__(self, options: tuple[str, ...]):
        self.options = options

    @property
    def describe(self) -> str:
        return "one of " + ", ".join(f"`{o}`" for o in self.options)

    def convert(self, value: ast.Value) -> Result:
        word = value.id if isinstance(value, ast.Name) else value.value if isinstance(value, ast.String) else None
        if word is None:
            return mismatch(self.describe, value)
        if word not in self.options:
            return INVALID, _err("RLP104", f"`{word}` is not {self.describe}", value.span,
                                 did_you_mean(word, self.options) or f"use {self.describe}")
        return word, []


class Quantity:
    """A number with a unit from ``units`` (sizes, durations, counts)."""

    def __init__(self, units: dict, describe: str, example: str, unit_optional: bool = False, whole: bool = False):
        self.units, self.describe, self.example, self.unit_optional = units, describe, example, unit_optional
        self.whole = whole  # bytes and parameter counts are integers

    def convert(self, value: ast.Value) -> Result:
        if not isinstance(value, ast.Number):
            return mismatch(self.describe, value)
        if value.unit == "" and not self.unit_optional:
            return INVALID, _err("RLP105", f"`{value.text}` has no unit: expected {self.describe}", value.span,
                                 f"add a unit, for example `{self.example}`")
        if value.unit not in self.units:
            known = [u for u in self.units if u]
            return INVALID, _err("RLP105", f"unknown unit `{value.unit}` in `{value.text}`: expected {self.describe}",
                                 value.span, did_you_mean(value.unit, known) or "units: " + ", ".join(known))
        if value.magnitude < 0:
            return INVALID, _err("RLP106", f"`{value.text}` is negative", value.span,
                                 f"write a value of 0 or more, such as `{self.example}`")
        amount = value.magnitude * self.units[value.unit]
        return (round(amount) if self.whole else amount), []


SIZE = Quantity(SIZE_UNITS, "a size such as `256MiB`", "256MiB", whole=True)
DURATION = Quantity(DURATION_UNITS, "a duration such as `30s`", "30s")
COUNT = Quantity(COUNT_UNITS, "a count such as `7B` or `350M`", "1.5B", unit_optional=True, whole=True)


class Fraction:
    """`80%` or `0.8`: a share in [0, 1]."""

    describe = "a fraction such as `80%` or `0.8`"

    def convert(self, value: ast.Value) -> Result:
        if not isinstance(value, ast.Number) or value.unit not in ("", "%"):
            return mismatch(self.describe, value)
        share = value.magnitude * PERCENT_UNITS.get(value.unit, 1.0)
        if not 0 <= share <= 1:
            return INVALID, _err("RLP106", f"`{value.text}` is not a fraction between 0% and 100%", value.span,
                                 "write a share from 0% to 100%, such as `80%` or `0.8`")
        return share, []


# -------------------------------------------------------------- references


class RefTo:
    """A reference to a declaration of one of ``kinds`` (model, stage, ...)."""

    def __init__(self, kinds: tuple[str, ...]):
        self.kinds = kinds

    @property
    def describe(self) -> str:
        return "the name of a " + " or ".join(self.kinds)

    def convert(self, value: ast.Value) -> Result:
        if isinstance(value, ast.Name):
            return Ref(value.id, value.span), []
        help = f"names are written without quotes: {value.value}" if isinstance(value, ast.String) else None
        return mismatch(self.describe, value, help)


class ListOf:
    def __init__(self, item: Any, allow_single: bool = True):
        self.item = item
        self.allow_single = allow_single  # `to = rollout` is short for `to = [rollout]`

    @property
    def describe(self) -> str:
        return f"a list of {self.item.describe.removeprefix('a ').removeprefix('an ')}"

    def convert(self, value: ast.Value) -> Result:
        items = value.items if isinstance(value, ast.ListValue) else (value,) if self.allow_single else None
        if items is None:
            return mismatch(self.describe, value)
        out, diags = [], []
        for item in items:
            converted, errs = self.item.convert(item)
            diags += errs
            out.append(converted)
        return (INVALID if diags else tuple(out)), diags


class GroupItem:
    """One member of `placement.groups`: a stage name or a list of them."""

    describe = "a stage name or a list of stage names"

    def convert(self, value: ast.Value) -> Result:
        if isinstance(value, ast.ListValue):
            return ListOf(RefTo(("stage",)), allow_single=False).convert(value)
        converted, diags = RefTo(("stage",)).convert(value)
        return (INVALID if diags else (converted,)), diags


class Gpus:
    describe = "a GPU count such as `2` or GPU ids such as `0..1` or `[0, 2..3]`"

    def convert(self, value: ast.Value) -> Result:
        if isinstance(value, ast.Number):
            count, diags = Int(low=0, describe=self.describe).convert(value)
            return (INVALID if diags else GpuRequest(count, None, value.span)), diags
        parts = value.items if isinstance(value, ast.ListValue) else (value,) if isinstance(value, ast.Range) else None
        if parts is None:
            return mismatch(self.describe, value)
        if not parts:
            return INVALID, _err("RLP104", "an empty GPU list", value.span, "write `gpus = 0` for a CPU stage")
        ids: list[int] = []
        for part in parts:
            got, diags = _gpu_ids(part)
            if diags:
                return INVALID, diags
            ids += got
        dupes = sorted(i for i, n in Counter(ids).items() if n > 1)
        if dupes:
            return INVALID, _err("RLP104", f"GPU {dupes[0]} is listed twice", value.span, "list each GPU once")
        return GpuRequest(len(ids), tuple(ids), value.span), []


MAX_GPU_ID = 65_535  # far beyond any cluster; keeps a typo like 0..99999999 from building a huge list


def _gpu_ids(part: ast.Value) -> tuple[list[int], list[Diagnostic]]:
    if isinstance(part, ast.Number) and part.is_integer and not part.unit and part.magnitude >= 0:
        return _gpu_id_range(part, part, part.span)
    if isinstance(part, ast.Range):
        ends = (part.low, part.high)
        if all(e.is_integer and not e.unit and e.magnitude >= 0 for e in ends) and part.low.magnitude <= part.high.magnitude:
            return _gpu_id_range(part.low, part.high, part.span)
        return [], _err("RLP104", "a GPU range is `low..high` with whole numbers, low <= high", part.span,
                        "write the range from its lowest id to its highest, such as `0..3`")
    return [], _err("RLP104", f"expected a GPU id or range, found {_shown(part)}", part.span,
                    "GPU ids are whole numbers such as `0`, or ranges such as `0..3`")


def _gpu_id_range(low: ast.Number, high: ast.Number, span: Span) -> tuple[list[int], list[Diagnostic]]:
    if high.magnitude > MAX_GPU_ID:
        return [], _err("RLP106", f"GPU id `{high.text}` is out of range: must be at most {MAX_GPU_ID}", span,
                        "use ids of the cluster's GPUs: 0 up to nodes x gpus_per_node - 1")
    return list(range(int(low.magnitude), int(high.magnitude) + 1)), []


# ------------------------------------------------------------------- calls


class CallOf:
    """`name(key = value, ...)`: engines and losses. ``signatures`` maps each
    callee to its argument types; a bare name is a call with no arguments."""

    def __init__(self, what: str, signatures: dict, build: Callable):
        self.what = what  # "engine" or "loss", for messages
        self.signatures = signatures  # name -> dict[arg name -> type]
        self.build = build

    @property
    def describe(self) -> str:
        return f"an {self.what} such as " + " or ".join(f"`{n}`" for n in self.signatures)

    def convert(self, value: ast.Value) -> Result:
        if isinstance(value, ast.Name):
            func, args, span = ast.Word(value.id, value.span), (), value.span
        elif isinstance(value, ast.Call):
            func, args, span = value.func, value.args, value.span
        else:
            return mismatch(self.describe, value)
        if func.text not in self.signatures:
            return INVALID, _err("RLP103", f"unknown {self.what} `{func.text}`", func.span,
                                 did_you_mean(func.text, self.signatures) or f"known: {', '.join(self.signatures)}")
        return self._arguments(func, args, span)

    def _arguments(self, func: ast.Word, args, span: Span) -> Result:
        signature = self.signatures[func.text]
        converted, spans, diags, warnings = {}, {}, [], []
        for arg in args:
            if arg.name is None:
                diags += _err("RLP104", f"{self.what} arguments are named", arg.span,
                              f"write `{func.text}({next(iter(signature), 'key')} = ...)`")
                continue
            key = arg.name.text
            renamed = renamed_argument(self.what, func.text, key)
            if renamed is not None and renamed.new in signature:
                arg, key, notice = _read_renamed(arg, renamed, func.text)
                warnings += notice
            if key not in signature:
                diags += _err("RLP103", f"`{func.text}` has no argument `{key}`", arg.name.span,
                              did_you_mean(key, signature) or f"arguments: {', '.join(signature) or 'none'}")
                continue
            if key in converted:
                diags += _err("RLP102", f"argument `{key}` given twice", arg.name.span, f"keep one `{key} = ...`")
                continue
            got, errs = signature[key].convert(arg.value)
            diags += errs
            if got is not INVALID:
                converted[key], spans[key] = got, arg.span
        if any(d.is_error for d in diags):
            return INVALID, diags + warnings
        return self.build(func.text, converted, span, spans, func.span), diags + warnings


def _read_renamed(arg: ast.Arg, renamed: RenamedArgument, callee: str) -> tuple[ast.Arg, str, list[Diagnostic]]:
    """An argument under its old name, read as the new one (RLP109); a value
    the old name did not take is left for the new name's own check."""
    old = arg.name.text
    written = arg.value.id if isinstance(arg.value, ast.Name) else \
        arg.value.value if isinstance(arg.value, ast.String) else None
    value = renamed.values.get(written, written)
    new_value = ast.Name(value, arg.value.span) if written is not None else arg.value
    rewrite = f"{renamed.new} = {value}" if written is not None else None
    warning = Diagnostic("RLP109", WARNING, f"`{callee}({old} = ...)` was renamed `{renamed.new}`"
                         + (f": read as `{rewrite}`" if rewrite else ""), arg.span,
                         help=f"write `{rewrite or renamed.new + ' = ...'}`; `rldsl fmt --fix FILE` rewrites every "
                              "renamed setting",
                         edit=(arg.span, rewrite) if rewrite else None)
    return ast.Arg(ast.Word(renamed.new, arg.name.span), new_value, arg.span), renamed.new, [warning]
