"""Renamed settings keep working (RLP109), and `rldsl fmt` rewrites files to
the current language with comments kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from rldsl.compiler.driver import compile_source
from rldsl.compiler.fmt import format_source

ROOT = Path(__file__).resolve().parent.parent
OLD = (ROOT / "tests" / "golden" / "RLP109.rlp").read_text()


def codes(text: str) -> list[str]:
    return sorted(d.code for d in compile_source(text, "old.rlp").diagnostics)


def test_an_old_spelling_runs_as_the_new_one_with_a_warning():
    old = compile_source(OLD, "old.rlp")
    new = compile_source(OLD.replace("level = sequence", "agg = seq_mean_token_mean"))
    assert old.ok and [d.code for d in old.diagnostics] == ["RLP109"]
    assert old.plan.pipelines == new.plan.pipelines
    assert "agg = seq_mean_token_mean" in old.diagnostics[0].help


def test_the_rename_no_longer_hides_the_findings_that_read_the_setting():
    """Before, `level` made the loss invalid and the train stage's rules were
    skipped: a sampling error went unreported until the rename was fixed."""
    broken = OLD.replace("level = sequence", "level = token, dual_clip = 0.5")  # dual_clip must be above 1
    assert "RLP312" in codes(broken) and "RLP109" in codes(broken) and "RLP103" not in codes(broken)


def test_a_value_the_old_name_never_took_is_an_error_of_the_new_name():
    assert "RLP104" in codes(OLD.replace("level = sequence", "level = sentence"))


def test_fmt_rewrites_renames_keeps_comments_and_is_stable():
    text, renamed = format_source(OLD, compile_source(OLD, "old.rlp").diagnostics)
    assert renamed == 1 and "agg = seq_mean_token_mean)   # written before `agg` replaced `level`" in text
    assert not compile_source(text).diagnostics
    assert format_source(text, compile_source(text).diagnostics) == (text, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["", " ", "\t", "   ", "\r"]), min_size=1, max_size=6),
       st.integers(min_value=0, max_value=3))
def test_fmt_is_idempotent_and_changes_only_layout(trailing, blank_lines):
    """Any trailing blanks, tabs, carriage returns and runs of empty lines:
    formatting twice equals formatting once, and the plan does not change."""
    lines = OLD.splitlines()
    messy = "\n".join(line + trailing[i % len(trailing)] + "\n" * (blank_lines if i % 5 == 0 else 0)
                      for i, line in enumerate(lines)) + "\n"
    once, _ = format_source(messy, compile_source(messy).diagnostics)
    twice, _ = format_source(once, compile_source(once).diagnostics)
    assert once == twice
    assert compile_source(once).plan.pipelines == compile_source(OLD).plan.pipelines


def rldsl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rldsl", *args], capture_output=True, text=True, cwd=cwd)


def test_fmt_command_checks_then_fixes(tmp_path):
    path = tmp_path / "old.rlp"
    path.write_text(OLD)
    shown = rldsl("fmt", str(path), cwd=tmp_path)
    assert shown.returncode == 1 and "+  loss = grpo(clip = 0.2, agg = seq_mean_token_mean)" in shown.stdout
    assert path.read_text() == OLD  # without --fix nothing is written
    fixed = rldsl("fmt", "--fix", str(tmp_path), cwd=tmp_path)  # a directory: every .rlp under it
    assert fixed.returncode == 0 and "(1 renamed setting)" in fixed.stdout
    clean = rldsl("fmt", str(path), cwd=tmp_path)
    assert clean.returncode == 0 and "1 file already in the current language and layout" in clean.stdout
    assert rldsl("check", "--strict", str(tmp_path), cwd=tmp_path).returncode == 0
    (tmp_path / "empty").mkdir()
    empty = rldsl("check", str(tmp_path / "empty"), cwd=tmp_path)
    assert empty.returncode == 2 and "holds no .rlp file" in empty.stderr


def test_fmt_refuses_a_file_it_cannot_parse(tmp_path):
    path = tmp_path / "broken.rlp"
    path.write_text("pipeline x\nstage train actor {\n")
    result = rldsl("fmt", "--fix", str(path), cwd=tmp_path)
    assert result.returncode == 1 and "RLP001" in result.stderr and "Traceback" not in result.stderr
    assert path.read_text() == "pipeline x\nstage train actor {\n"


def test_shipped_pipelines_are_formatted():
    result = rldsl("fmt", "pipelines", cwd=ROOT)
    assert result.returncode == 0, result.stdout
    assert f"{len(list((ROOT / 'pipelines').glob('*.rlp')))} files already in the current language" in result.stdout
