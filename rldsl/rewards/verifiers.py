"""The answer checkers of GSM8K and competition math, as the RL frameworks
score them (docs/language.md, "stage reward").

- ``gsm8k``: the number after the response's last ``####``, else its last
  number, equal in value to the reference's;
- ``gsm8k_strict``: verl's default GSM8K rule, text for text;
- ``math``: math-verify when it is installed (``pip install 'rldsl[math]'``),
  else ``boxed_match``;
- ``boxed_match``: the response's last ``\\boxed{...}`` against the reference,
  both in the normal form of ``rldsl.rewards.latex``.

Each takes ``(response, answer, prompt)`` and returns 1.0 or 0.0. A
reference answer holding ``#### N`` (a GSM8K solution as the dataset ships
it) counts as ``N``.
"""

from __future__ import annotations

import functools
import logging
import re
from decimal import Decimal, InvalidOperation

from rldsl.rewards.latex import equivalent, last_boxed

_NUMBER = r"[-$]{0,2}\d[\d,]*(?:\.\d+)?"
_AFTER_HASHES = re.compile(rf"####\s*({_NUMBER})")
_ANY_NUMBER = re.compile(_NUMBER)
# verl's rule: "#### " and a run of digits, signs, dots and commas, in the last 300 characters
_VERL_AFTER_HASHES = re.compile(r"#### (-?[0-9.,]+)")
VERL_TAIL_CHARACTERS = 300


def gsm8k(response: str, answer: str, prompt: str = "") -> float:
    """1.0 when the number after the response's last ``####`` (else its last
    number) has the reference's value: commas and ``$`` dropped, ``72.0`` is
    ``72``. A response without a number scores 0."""
    found = _AFTER_HASHES.findall(response) or _ANY_NUMBER.findall(response)
    if not found:
        return 0.0
    return 1.0 if _same_value(_plain_number(found[-1]), _plain_number(_reference(answer))) else 0.0


def gsm8k_strict(response: str, answer: str, prompt: str = "") -> float:
    """verl's GSM8K score (``method = "strict"``, its default): the last
    ``#### N`` in the response's last 300 characters, commas removed, equal
    as text to the reference. No ``####``: 0. ``#### 72.`` (a full stop
    after it) is ``72.``, which is not ``72``, as in verl."""
    found = _VERL_AFTER_HASHES.findall(response[-VERL_TAIL_CHARACTERS:])
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(",", "") == _reference(answer).replace(",", "") else 0.0


def _reference(answer: str) -> str:
    """The final number of a GSM8K solution (``... #### 1,600`` is ``1600``), else the answer as given."""
    found = _AFTER_HASHES.findall(answer)
    return _plain_number(found[-1]) if found else answer.strip()


def _plain_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def _same_value(predicted: str, reference: str) -> bool:
    try:
        return Decimal(predicted) == Decimal(reference)
    except InvalidOperation:  # a reference that is not a number: compare the text
        return predicted == reference


def math(response: str, answer: str, prompt: str = "") -> float:
    """1.0 when the response's final answer is the reference's. With
    math-verify installed, as NeMo RL's math environment verifies: the
    reference read as ``\\boxed{answer}``, the response's answer found in
    its LaTeX or plain expressions, compared symbolically. Without it,
    ``boxed_match``."""
    verify = _math_verify()
    return verify(response, _reference(answer)) if verify is not None else boxed_match(response, answer)


def boxed_match(response: str, answer: str, prompt: str = "") -> float:
    """1.0 when the response's last ``\\boxed{...}`` is equivalent to the
    reference (its own last ``\\boxed{...}`` when it has one) in the normal
    form of ``rldsl.rewards.latex``. A response without ``\\boxed`` scores 0."""
    predicted = last_boxed(response)
    if predicted is None:
        return 0.0
    answer = _reference(answer)
    boxed = last_boxed(answer)
    return 1.0 if equivalent(predicted, answer if boxed is None else boxed) else 0.0


@functools.lru_cache(maxsize=1)
def _math_verify():
    """math-verify's check as ``(response, answer) -> float``; None when it
    is not installed. Its own timeouts are signal alarms, which work only in
    a main thread: they are off here, and the reward stage's `timeout`
    bounds the call instead."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError:
        return None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warning that the timeouts are off
    reference_targets, response_targets = (LatexExtractionConfig(),), (ExprExtractionConfig(), LatexExtractionConfig())

    def verified(response: str, answer: str) -> float:
        boxed = answer if "\\boxed" in answer else "\\boxed{" + answer + "}"
        reference = parse(boxed, reference_targets, parsing_timeout=None)
        predicted = parse(response, response_targets, parsing_timeout=None)
        return 1.0 if reference and predicted and verify(reference, predicted, timeout_seconds=None) else 0.0

    return verified
