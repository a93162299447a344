"""The shipped prompt templates and answer parsers of a generating judge.

A reward stage with `judge = generate` asks its model, greedily, the text
``template(prompt, response, answer)`` and reads the reward from the answer
with ``parse(text) -> float``. A parser that cannot read a reward raises
``JudgeParseError`` (or anything else): that sample is dropped as
``reward_invalid`` with the judge's text. Pipelines name their own as
``"module:function"`` (`template = ...`, `parse = ...`).
"""

from __future__ import annotations

import re

__all__ = ["JudgeParseError", "compact_prompt", "first_number", "judge_prompt", "out_of_ten", "yes_no"]

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class JudgeParseError(ValueError):
    """The judge's answer holds no reward."""


def judge_prompt(prompt: str, response: str, answer: str) -> str:
    """The default: the question, the reference answer and the response, and
    a request for a score from 0 to 10 (read by ``out_of_ten``)."""
    return ("You are grading a response to a question against its reference answer.\n"
            f"Question:\n{prompt}\n\nReference answer:\n{answer}\n\nResponse:\n{response}\n\n"
            "Rate the response from 0 (wrong) to 10 (fully correct). Reply with the number only.\nScore: ")


def compact_prompt(prompt: str, response: str, answer: str) -> str:
    """For models with a short context (`builtin:tiny-lm` holds 64 tokens):
    the question with the response in place of the answer, ``12+7=19=``."""
    return f"{prompt}{response}="


def first_number(text: str) -> float:
    """The first number in the judge's answer: ``"Score: 7/10"`` -> 7.0."""
    found = _NUMBER.search(text)
    if found is None:
        raise JudgeParseError(f"no number in the judge's answer {text!r}")
    return float(found.group())


def out_of_ten(text: str) -> float:
    """The default: the first number, a score out of 10, as a reward in [0, 1] (clamped)."""
    return min(max(first_number(text), 0.0), 10.0) / 10.0


def yes_no(text: str) -> float:
    """1.0 when the answer starts with yes (or true, correct), 0.0 for no (false, incorrect)."""
    word = re.match(r"\W*(\w+)", text.lower())
    first = word.group(1) if word else ""
    if first in ("yes", "true", "correct"):
        return 1.0
    if first in ("no", "false", "incorrect", "wrong"):
        return 0.0
    raise JudgeParseError(f"neither yes nor no in the judge's answer {text!r}")
