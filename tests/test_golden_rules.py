"""Every rule has a failing example in tests/golden/CODE.rlp whose rendered
diagnostics are pinned in CODE.out. RLDSL_UPDATE_GOLDEN=1 rewrites them."""

import os
from pathlib import Path

import pytest

from rldsl.compiler.diagnostics import render_text
from rldsl.compiler.driver import compile_file
from rldsl.compiler.rules.catalog import RULES

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p.stem for p in GOLDEN.glob("RLP*.rlp"))


def test_every_rule_has_a_golden_example():
    assert sorted(RULES) == CASES


def test_base_example_is_clean():
    result = compile_file(GOLDEN / "base.rlp")
    assert result.ok and not result.diagnostics, result.diagnostics


@pytest.mark.parametrize("code", CASES)
def test_golden_diagnostics(code):
    path = GOLDEN / f"{code}.rlp"
    result = compile_file(path)
    codes = {d.code for d in result.diagnostics}
    assert code in codes, f"{code} did not fire; got {sorted(codes)}"
    rendered = render_text(result.diagnostics, result.source, f"{code}.rlp")
    expected_path = GOLDEN / f"{code}.out"
    if os.environ.get("RLDSL_UPDATE_GOLDEN") or not expected_path.exists():
        expected_path.write_text(rendered)
    assert rendered == expected_path.read_text()


@pytest.mark.parametrize("code", CASES)
def test_severity_matches_catalog(code):
    result = compile_file(GOLDEN / f"{code}.rlp")
    fired = [d for d in result.diagnostics if d.code == code]
    assert all(d.severity == RULES[code].severity for d in fired)
    if RULES[code].severity == "error":
        assert result.plan is None  # an error never yields a plan
