"""Final answers written in LaTeX: the last ``\\boxed{...}`` of a response,
and a normal form in which two answers that differ only in writing compare
equal. ``rldsl.rewards:boxed_match`` is built on these.

The normal form, step by step (``normal_form``):

- spacing commands (``\\,`` ``\\;`` ``\\:`` ``\\!`` ``\\ ``), ``\\left`` and
  ``\\right``, ``$`` signs and every space go;
- ``\\dfrac`` and ``\\tfrac`` are ``\\frac``; ``\\frac12`` is ``\\frac{1}{2}``,
  ``\\sqrt2`` is ``\\sqrt{2}``; every ``\\frac{a}{b}`` is written ``a/b``, with
  parentheses around a term that is a sum, difference, quotient or list
  (``\\frac{x+1}{2}`` is ``(x+1)/2``);
- degrees (``^\\circ``, ``^{\\circ}``, ``°``) and percent signs go;
- ``\\text{...}`` (and ``\\textbf``, ``\\mbox``, ``\\mathrm``) after a value is a
  unit and goes (``5\\text{ cm}`` is ``5``); on its own it is its text;
- a leading ``x =`` (one short name) goes, as does a trailing full stop;
- thousands separators go (``1,000`` and ``1{,}000`` are ``1000``), ``.5``
  is ``0.5``.

Two answers are equivalent when their normal forms are equal or both are
numbers (integers, decimals, ``a/b``) within a relative 1e-6 of each other.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])\s*")
_SPACING = re.compile(r"\\[,;:! ]|\\(?:left|right)(?![a-zA-Z])|\\(?:q?quad)(?![a-zA-Z])|\\?\$")
_TEXT = r"\\(?:text|textbf|textrm|mbox|mathrm)\s*\{([^{}]*)\}"
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\%|%")
_COMPOUND = re.compile(r".[-+/=,]")  # a sum, difference, quotient, equation or list (a leading sign is not)
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
RELATIVE_TOLERANCE = 1e-6


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with its
    braces balanced (escaped ``\\{`` ``\\}`` do not count); ``\\boxed 5`` gives
    ``5``. None when there is none, or it is never closed."""
    starts = list(_BOXED.finditer(text))
    if not starts:
        return None
    start = starts[-1].end()
    if not text.startswith("{", start):
        bare = re.match(r"[^\s$]+", text[start:])
        return bare.group(0) if bare else None
    return _braced(text, start)[0]


def normal_form(answer: str) -> str:
    """``answer`` as the module docstring's steps write it."""
    text = _SPACING.sub(" ", answer.strip()).replace("{,}", ",")
    text = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", text)
    text = _DEGREES.sub("", text)
    text = _without_units(text)
    text = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\sqrt\s*(\d+|[a-zA-Z])", r"\\sqrt{\1}", text)
    text = re.sub(r"\s+", "", text)
    text = _slashed_fractions(text)
    text = re.sub(r"^[a-zA-Z]\w{0,2}=(?=[^=]+$)", "", text)
    text = text.rstrip(".")
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return re.sub(r"(?<![\d.])\.(\d)", r"0.\1", text)


def _without_units(text: str) -> str:
    """Trailing ``\\text{...}`` after a value dropped (a unit); any other ``\\text{x}`` becomes ``x``."""
    while True:
        unit = re.search(rf"\s*{_TEXT}\s*$", text)
        if unit is None or not text[:unit.start()].strip():
            break
        text = text[:unit.start()]
    return re.sub(_TEXT, r"\1", text)


def _slashed_fractions(text: str) -> str:
    """Each ``\\frac{a}{b}`` as ``a/b``, nested ones too; a term that is a
    sum, difference, quotient or list gets parentheses: ``(a+1)/b``."""
    start = text.find("\\frac{")
    if start < 0:
        return text
    numerator, middle = _braced(text, start + len("\\frac"))
    denominator, end = _braced(text, middle) if numerator is not None else (None, middle)
    if denominator is None:
        return text
    terms = [_slashed_fractions(term) for term in (numerator, denominator)]
    slashed = "/".join(f"({term})" if _COMPOUND.search(term) else term for term in terms)
    return text[:start] + slashed + _slashed_fractions(text[end:])


def _braced(text: str, start: int) -> tuple[str | None, int]:
    """The content of the brace group opening at ``start`` and the position
    after it; (None, start) when none opens there or it never closes.
    Escaped braces (``\\{``) do not count."""
    if not text.startswith("{", start):
        return None, start
    depth, position = 0, start
    while position < len(text):
        char = text[position]
        if char == "\\":
            position += 2
            continue
        depth += {"{": 1, "}": -1}.get(char, 0)
        position += 1
        if depth == 0:
            return text[start + 1:position - 1], position
    return None, start


def as_number(text: str) -> Fraction | None:
    """The value of a normal form that is a number, ``a/b`` or ``(a)/(b)``; else None."""
    parts = text.split("/")
    if len(parts) > 2:
        return None
    numbers = [part[1:-1] if part.startswith("(") and part.endswith(")") else part for part in parts]
    if not all(_NUMBER.fullmatch(number) for number in numbers):
        return None
    values = [Fraction(number) for number in numbers]
    if len(values) == 2 and values[1] == 0:
        return None
    return values[0] / values[1] if len(values) == 2 else values[0]


def equivalent(predicted: str, reference: str) -> bool:
    """Whether two answers are the same once written in normal form."""
    predicted, reference = normal_form(predicted), normal_form(reference)
    if predicted == reference:
        return bool(predicted)
    left, right = as_number(predicted), as_number(reference)
    if left is None or right is None:
        return False
    return abs(left - right) <= RELATIVE_TOLERANCE * max(1, abs(right))
