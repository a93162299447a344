"""Files that checked keep checking: every `.rlp` the project has shipped
(every version of pipelines/ at every commit, and the whole pipelines in
the docs and README that checked when they were written) is in
tests/compat/, taken from git history by tests/compat/harvest.py, with its
origin in tests/compat/index.json. Each checks with the current compiler
with no error (warnings allowed: an old meaning kept, RLP109 and
rldsl.compiler.old_meanings.KEPT_MEANINGS), and `rldsl fmt --fix` writes it
in the current form with the same plan. A new file in pipelines/ joins the
corpus (run the harvest)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_file, compile_source
from rldsl.compiler.fmt import format_source
from rldsl.compiler.old_meanings import KEPT_MEANINGS

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "compat"
INDEX = json.loads((CORPUS / "index.json").read_text())
FILES = [entry["file"] for entry in INDEX]
FROM_HISTORY = [entry for entry in INDEX if entry["commit"] != "worktree"]
HARVEST = "run `python tests/compat/harvest.py`: it adds the shipped files missing from the corpus"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_the_corpus_is_the_shipped_history_and_only_grows():
    """52 files from history when the corpus was made (45 versions of pipelines/, 7 examples in the docs and
    README); the index names every file and every file is indexed."""
    assert len(FROM_HISTORY) >= 52, [entry["file"] for entry in FROM_HISTORY]
    assert sorted(p.name for p in CORPUS.glob("*.rlp")) == sorted(FILES)
    assert all(entry["origin"] and entry["commit"] for entry in INDEX)
    assert len({digest((CORPUS / name).read_text()) for name in FILES}) == len(FILES)  # deduplicated


def test_every_shipped_pipeline_is_in_the_corpus():
    corpus = {digest((CORPUS / name).read_text()) for name in FILES}
    missing = [p.name for p in sorted((ROOT / "pipelines").glob("*.rlp")) if digest(p.read_text()) not in corpus]
    assert not missing, f"{missing}: {HARVEST}"


@pytest.mark.parametrize("name", FILES)
def test_a_shipped_file_still_checks(name):
    # a shipped pipeline is checked where it lies, beside the modules it names (pipelines/openenv_arith.py)
    beside = ROOT / "pipelines" if name.startswith("pipelines-") else CORPUS
    result = compile_source((CORPUS / name).read_text(encoding="utf-8"), str(beside / name), base_dir=beside)
    errors = [f"{d.code} {d.span.line}:{d.span.col} {d.message}" for d in result.diagnostics if d.is_error]
    assert not errors, errors
    assert result.plan is not None


OLD_FORMS = [name for name in FILES
             if any(d.code in KEPT_MEANINGS for d in compile_file(CORPUS / name, want_plan=False).diagnostics)]


def test_the_old_forms_are_the_ones_the_language_moved_past():
    """The renamed loss argument (RLP109), GPUs shared before `share` (RLP509), logprob forwards the honest
    estimate no longer fits (RLP520): each kept, so the corpus checks."""
    kept = {d.code for name in OLD_FORMS for d in compile_file(CORPUS / name, want_plan=False).diagnostics}
    assert {"RLP109", "RLP509", "RLP520"} <= kept


@pytest.mark.parametrize("name", OLD_FORMS)
def test_fmt_writes_an_old_file_in_the_current_form_with_the_same_plan(name):
    text = (CORPUS / name).read_text()
    old = compile_source(text, name, base_dir=CORPUS)
    formatted, rewritten = format_source(text, old.diagnostics)
    new = compile_source(formatted, name, base_dir=CORPUS)
    assert rewritten and not [d.code for d in new.diagnostics if d.code in KEPT_MEANINGS or d.is_error]
    assert new.plan.pipelines == old.plan.pipelines
    assert format_source(formatted, new.diagnostics) == (formatted, 0)
