"""The GSM8K and math answer checkers (rldsl.rewards.verifiers) and the
LaTeX normal form they compare in (rldsl.rewards.latex)."""

from __future__ import annotations

import sys

import pytest

from rldsl.rewards import boxed_match, gsm8k, gsm8k_strict, load_reward, math
from rldsl.rewards import verifiers
from rldsl.rewards.latex import equivalent, last_boxed, normal_form

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72.\n#### 72"

# -- GSM8K ---------------------------------------------------------------------------------


@pytest.mark.parametrize("response, answer, expected", [
    ("She sold 24, then 48+24=72.\n#### 72", "72", 1.0),
    ("#### 72", GSM8K_SOLUTION, 1.0),              # the reference is a whole GSM8K solution
    ("#### 1,600", "1600", 1.0),                    # commas dropped
    ("The total is $1,600.", "1600", 1.0),          # no ####: the last number, `$` and the full stop dropped
    ("#### 72.00", "72", 1.0),                      # equal in value
    ("#### -3", "-3", 1.0),
    ("#### 7 then 72 later", "72", 0.0),            # the number after #### wins over a later one
    ("#### 70\n#### 72", "72", 1.0),                # the last ####
    ("I think 72, no wait, 27", "72", 0.0),         # the last number
    ("no number here", "72", 0.0),
    ("", "72", 0.0),
    ("#### 0.5", ".5", 1.0),
])
def test_gsm8k(response, answer, expected):
    assert gsm8k(response, answer) == expected


@pytest.mark.parametrize("response, answer, expected", [
    ("... so 72.\n#### 72", "72", 1.0),
    ("#### 72", GSM8K_SOLUTION, 1.0),
    ("#### 1,600", "1600", 1.0),
    ("The answer is 72", "72", 0.0),                # no ####: verl scores 0
    ("####72", "72", 0.0),                          # verl needs the space
    ("#### 72.", "72", 0.0),                        # verl reads `72.`, not 72
    ("#### 72.0", "72", 0.0),                       # compared as text
    ("#### 70 then #### 72", "72", 1.0),            # the last one
    ("#### 72" + " padding" * 60, "72", 0.0),       # only the last 300 characters are read
])
def test_gsm8k_strict_is_verls_default_rule(response, answer, expected):
    assert gsm8k_strict(response, answer) == expected


# -- LaTeX answers ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, boxed", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} first, then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),   # the last one
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),                                 # escaped braces do not close it
    (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),         # nested braces
    (r"$\boxed 5$", "5"),
    (r"\fbox{7}", "7"),
    (r"\boxed{never closed", None),
    ("no box", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize("left, right", [
    (r"\frac{1}{2}", "1/2"),
    (r"\dfrac{3}{4}", r"\frac34"),
    (r"\tfrac{3}{4}", "0.75"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"90^\circ", "90"),
    (r"90^{\circ}", "90"),
    (r"5 \text{ cm}", "5"),
    (r"12\mbox{ inches}", "12"),
    (r"\text{(B)}", "(B)"),
    ("x = 5", "5"),
    ("5.", "5"),
    ("1,000", "1000"),
    ("1{,}000", "1000"),
    (r"10\,000", "10000"),
    (".5", "0.5"),
    (r"50\%", "50"),
    (r"\$18", "18"),
    (r"-\frac{1}{2}", "-0.5"),
    (r"\frac{-1}{2}", r"-\frac12"),
    (r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2"),
    (r"\frac{\sqrt3}{2}", r"\frac{\sqrt{3}}{2}"),
    (r"\frac{x+1}{2}", "(x+1)/2"),
    ("0.3333333", r"\frac{1}{3}"),                  # numbers within 1e-6
])
def test_equivalent_writings(left, right):
    assert equivalent(left, right) and equivalent(right, left)


@pytest.mark.parametrize("left, right", [
    (r"\frac{1}{2}", "2"),
    ("0.33", r"\frac{1}{3}"),
    (r"\frac{x+1}{2}", "x+1/2"),                    # the parentheses keep the meaning
    (r"\sqrt{2}", "2"),
    ("", ""),
    (r"\frac{1}{0}", "0"),
])
def test_different_answers(left, right):
    assert not equivalent(left, right)


def test_normal_form_is_stable():
    for text in [r"\left(\dfrac{1}{2}, 3\right)", r"5\text{ cm}", r"x = \frac{a+b}{c}", r"\$1{,}000.50"]:
        once = normal_form(text)
        assert normal_form(once) == once


@pytest.mark.parametrize("response, answer, expected", [
    (r"Thus the answer is $\boxed{\dfrac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{5\text{ cm}}", r"\boxed{5}", 1.0),         # a reference's own \boxed is read too
    (r"\boxed{\left(2, 3\right)}", "(2,3)", 1.0),
    (r"\boxed{3} then corrected: \boxed{4}", "4", 1.0),
    ("The answer is 1/2.", "1/2", 0.0),                  # no \boxed: 0 without math-verify
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"\boxed{72}", GSM8K_SOLUTION, 1.0),                 # a GSM8K solution counts as its final number
    (r"\boxed{1600}", "So 1,600 in all.\n#### 1,600", 1.0),
])
def test_boxed_match(response, answer, expected):
    assert boxed_match(response, answer) == expected


# -- math: math-verify when installed, boxed_match otherwise -------------------------------------


@pytest.fixture
def without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now raises ImportError
    verifiers._math_verify.cache_clear()
    yield
    verifiers._math_verify.cache_clear()


def test_math_without_math_verify_is_boxed_match(without_math_verify):
    assert verifiers._math_verify() is None
    assert math(r"so \boxed{\dfrac{1}{2}}", "0.5") == 1.0
    assert math("so 1/2", "0.5") == 0.0


@pytest.mark.parametrize("response, answer, expected", [
    (r"Thus $\boxed{\dfrac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{\frac{2}{4}}", r"\frac12", 1.0),           # symbolic, not only written alike
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    ("The final answer is 72.", "72", 1.0),              # plain expressions are read too
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{1600}", "So 1,600 in all.\n#### 1,600", 1.0),  # a GSM8K solution counts as its final number
    (r"\boxed{3}", "4", 0.0),
    ("no answer", "4", 0.0),
])
def test_math_with_math_verify(response, answer, expected):
    pytest.importorskip("math_verify")
    verifiers._math_verify.cache_clear()
    assert verifiers._math_verify() is not None
    assert math(response, answer) == expected


def test_the_checkers_load_by_name():
    for function in (gsm8k, gsm8k_strict, math, boxed_match):
        assert load_reward(f"rldsl.rewards:{function.__name__}") is function
