"""Docs stay true to the code they describe."""

from pathlib import Path

from rldsl.compiler.rules.catalog import RULES, render_markdown
from rldsl.compiler.schema import BLOCK_KEYS, STAGE_KEYS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_rules_md_is_generated_from_the_catalog():
    assert (DOCS / "rules.md").read_text() == render_markdown(), \
        "regenerate: python -m rldsl.compiler.rules.catalog > docs/rules.md"


def test_every_rule_is_documented():
    text = (DOCS / "rules.md").read_text()
    assert all(f"## {code}:" in text for code in RULES)


def test_language_reference_names_every_key():
    text = (DOCS / "language.md").read_text()
    keys = {k for table in (*BLOCK_KEYS.values(), *STAGE_KEYS.values()) for k in table}
    missing = sorted(k for k in keys if f"`{k}`" not in text)
    assert not missing, f"docs/language.md does not describe: {missing}"
