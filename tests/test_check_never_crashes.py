"""`check` never shows a traceback: bounded nesting, one line model for
positions and snippets, long lines as a window, internal errors as exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rldsl import cli
from rldsl.compiler.diagnostics import render_text
from rldsl.compiler.driver import compile_source

ROOT = Path(__file__).resolve().parent.parent
BASE = (ROOT / "tests" / "golden" / "base.rlp").read_text()


def check(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "p.rlp"
    path.write_text(text)
    return subprocess.run([sys.executable, "-m", "rldsl", "check", str(path), *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def _wrapped(char: str, count: int) -> str:
    """``count`` brackets, a hundred per line: deep, yet every line short."""
    return "\n".join(char * min(100, count - start) for start in range(0, count, 100))


@pytest.mark.parametrize("depth", [33, 300, 20_000])
def test_deep_nesting_is_a_finding_not_a_traceback(tmp_path, depth):
    text = BASE.replace("}\n", "  extra = " + _wrapped("[", depth) + _wrapped("]", depth) + "\n}\n", 1)
    proc = check(tmp_path, text, "--format", "json")
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert [d["code"] for d in report["diagnostics"]] == ["RLP002"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("separator", ["\f", "\v", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r"])
def test_the_snippet_shows_the_line_the_position_names(separator):
    text = BASE.replace("pipeline demo\n", f"pipeline demo  # a comment{separator}with a separator in it\n", 1)
    text = text.replace("samples_per_prompt = 4", "samples_per_promt = 4")
    result = compile_source(text)
    finding = next(d for d in result.diagnostics if d.code == "RLP103")
    rendered = render_text([finding], text, "p.rlp")
    shown = rendered.splitlines()[3]
    assert shown.startswith(f"{finding.span.line} |") and "samples_per_promt" in shown
    caret_line = rendered.splitlines()[4]
    assert shown[caret_line.index("^"):].startswith("samples_per_promt")


def test_a_long_line_is_shown_as_a_window_around_the_caret(tmp_path):
    text = BASE.replace("samples_per_prompt = 4", "samples_per_prompt = 4" + " " * 15_000 + "bogus = 1")
    proc = check(tmp_path, text)
    assert proc.returncode == 1
    assert len(proc.stderr) < 2_000
    lines = proc.stderr.splitlines()
    snippet = next(line for line in lines if "| " in line and "bogus = 1" in line)
    caret = lines[lines.index(snippet) + 1]
    assert snippet[caret.index("^"):].startswith("bogus")


def test_a_megabyte_line_is_refused_at_once_and_shown_as_a_window(tmp_path):
    text = BASE.replace("samples_per_prompt = 4", "samples_per_prompt = 4" + " " * 5_000_000 + "bogus = 1")
    proc = check(tmp_path, text, "--format", "json")
    assert proc.returncode == 1
    assert [d["code"] for d in json.loads(proc.stdout)["diagnostics"]] == ["RLP003"]
    assert len(check(tmp_path, text).stderr) < 2_000


def test_an_internal_error_is_exit_2_and_says_so(monkeypatch, capsys, tmp_path):
    path = tmp_path / "p.rlp"
    path.write_text(BASE)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("rldsl.compiler.driver.compile_file", broken)
    assert cli.main(["check", str(path), "--format", "json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"internal_error": "ZeroDivisionError: a bug", "valid": False}
    assert err.startswith("internal error: ZeroDivisionError: a bug")


@pytest.mark.parametrize(("value", "message"), [
    ("1" * 400, "is too large: numbers stay within ±1e18"),
    ("1e400", "`1e400` is too large"),
    ("[0..99999999]", "GPU id `99999999` is out of range: must be at most 65535"),
])
def test_huge_numbers_are_findings(value, message):
    """An overflowing literal raised OverflowError; a huge GPU range built a list of 100 million ids."""
    result = compile_source(BASE.replace("gpus = 2\n  samples", f"gpus = {value}\n  samples", 1))
    assert [d.code for d in result.diagnostics] == ["RLP106"] and message in result.diagnostics[0].message
