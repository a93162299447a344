"""Order and comments never change what `check` finds: reordering the
top-level blocks of a file, or adding comments and blank lines, gives the
same findings (codes and messages), over the shipped pipelines and the
golden examples."""

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lark.exceptions import UnexpectedInput

from rldsl.compiler.driver import compile_source
from rldsl.compiler.parser import _lark

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted((ROOT / "pipelines").glob("*.rlp")) + sorted((ROOT / "tests" / "golden").glob("*.rlp"))
TEXTS = {path.relative_to(ROOT).as_posix(): path.read_text() for path in FILES}
FILLER = ["", "# a comment", "   # an indented comment -> { } [ ] \"", "\t", "#"]


def findings(text: str, base_dir: Path) -> set[tuple[str, str]]:
    return {(d.code, d.message) for d in compile_source(text, "m.rlp", base_dir=base_dir).diagnostics}


def top_level_items(text: str) -> list[str] | None:
    """The text of each top-level item (a block, a flow, a pipeline or its header); None when it does not parse."""
    try:
        tree = _lark().parse(text)
    except UnexpectedInput:
        return None
    return [text[child.meta.start_pos:child.meta.end_pos] for child in tree.children]


def with_filler(text: str, data) -> str:
    """Comment and blank lines between lines (never inside one: strings and comments end with their line)."""
    out = []
    for line in text.split("\n"):
        out += data.draw(st.lists(st.sampled_from(FILLER), max_size=2))
        out.append(line)
    return "\n".join(out)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(TEXTS)), st.data())
def test_reordering_blocks_and_adding_comments_keeps_the_findings(name, data):
    text, base_dir = TEXTS[name], (ROOT / name).parent
    expected = findings(text, base_dir)
    items = top_level_items(text)
    if items is not None:
        order = data.draw(st.permutations(range(len(items))))
        text = "\n".join(items[i] for i in order)
    assert findings(with_filler(text, data), base_dir) == expected, name


def test_every_file_but_the_syntax_examples_is_reordered():
    unparsed = sorted(name for name, text in TEXTS.items() if top_level_items(text) is None)
    assert unparsed == ["tests/golden/RLP001.rlp"]
