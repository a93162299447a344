"""Harvest the compatibility corpus: every `.rlp` the project has shipped.

    python tests/compat/harvest.py

Reads git history (never changes it): every version of every file under
`pipelines/` at every commit, and every fenced block of `docs/*.md` and
`README.md` that declares a pipeline. A candidate joins the corpus when the
compiler *of the commit that first shipped it* checked it with no error
(blocks written to show an error, or elided with `...`, never checked).
The working tree's pipelines/ join too, so a new shipped file is in the
corpus before it is committed.

Only adds: a file already in the corpus stays (the corpus is history), and
content already there under another name is not added twice. Each file's
origin is in index.json; tests/test_compat.py checks them all with the
current compiler.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = Path(__file__).resolve().parent
INDEX = CORPUS / "index.json"
DOCS = ("docs/", "README.md")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
PIPELINE_LINE = re.compile(r"^pipeline\s+\w+", re.M)
ERROR_LINE = re.compile(r"^error(\[|:)", re.M)
WORKTREE = "worktree"  # the commit of a pipeline file not committed yet (named after HEAD, with a `+`)


@dataclass(frozen=True)
class Candidate:
    origin: str  # the shipped path: pipelines/x.rlp, or docs/x.md:LINE for a block
    commit: str  # the first commit that shipped this text ("worktree" for uncommitted pipelines)
    date: str
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def filename(self) -> str:
        where = self.origin.replace("/", "-").replace(".rlp", "").replace(".md:", "-L").replace(".", "-")
        commit = self.commit[:7] if self.commit != WORKTREE else f"{git('rev-parse', '--short=7', 'HEAD').strip()}+"
        return f"{where}@{commit}.rlp"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def commits() -> list[tuple[str, str]]:
    """(hash, date) of every commit, oldest first."""
    lines = git("log", "--all", "--reverse", "--topo-order", "--format=%H %ad", "--date=short").split("\n")
    return [tuple(line.split()) for line in lines if line]


def shipped_files(commit: str) -> list[tuple[str, str]]:
    """(path, blob) of the pipelines and docs at ``commit``."""
    out = []
    for line in git("ls-tree", "-r", commit).split("\n"):
        if not line:
            continue
        meta, path = line.split("\t", 1)
        is_pipeline = path.startswith("pipelines/") and path.endswith(".rlp")
        is_doc = path.endswith(".md") and (path.startswith("docs/") and "/" not in path[5:] or path == "README.md")
        if is_pipeline or is_doc:
            out.append((path, meta.split()[2]))
    return out


def pipeline_blocks(markdown: str) -> list[tuple[int, str]]:
    """(line, text) of the fenced blocks that declare a pipeline and are no shell transcript."""
    blocks = []
    for match in FENCE.finditer(markdown):
        body = match.group(1)
        if PIPELINE_LINE.search(body) and not re.search(r"^\$ ", body, re.M):
            blocks.append((markdown.count("\n", 0, match.start()) + 2, body))
    return blocks


def candidates() -> list[Candidate]:
    """Every distinct shipped text, with the first commit that shipped it."""
    seen: dict[str, Candidate] = {}
    blobs: dict[str, str] = {}
    for commit, date in commits():
        for path, blob in shipped_files(commit):
            text = blobs.setdefault(blob, git("cat-file", "blob", blob))
            found = [(path, text)] if path.endswith(".rlp") else \
                [(f"{path}:{line}", body) for line, body in pipeline_blocks(text)]
            for origin, body in found:
                candidate = Candidate(origin, commit, date, body)
                seen.setdefault(candidate.digest, candidate)
    for path in sorted((ROOT / "pipelines").glob("*.rlp")):
        candidate = Candidate(f"pipelines/{path.name}", WORKTREE, "", path.read_text())
        seen.setdefault(candidate.digest, candidate)
    return list(seen.values())


def checked_when_shipped(candidate: Candidate, trees: dict[str, Path], scratch: Path) -> bool:
    """Whether the compiler of the commit that shipped it found no error (the working tree's for a new file)."""
    if candidate.commit == WORKTREE:
        tree = ROOT
    else:
        tree = trees.get(candidate.commit) or _extract(candidate.commit, scratch)
        trees[candidate.commit] = tree
    if candidate.origin.startswith("pipelines/"):
        path = tree / candidate.origin  # where it was: files beside it resolve as they did
    else:
        path = tree / f"compat-{candidate.digest[:12]}.rlp"
        path.write_text(candidate.text)
    try:
        env = {**os.environ, "PYTHONPATH": str(tree), "NO_COLOR": "1"}
        result = subprocess.run([sys.executable, "-m", "rldsl", "check", str(path)], cwd=tree, env=env,
                                capture_output=True, text=True, timeout=120, check=False)
    finally:
        if not candidate.origin.startswith("pipelines/"):
            path.unlink()
    output = result.stdout + result.stderr
    return result.returncode in (0, 1) and not ERROR_LINE.search(output) and "Traceback" not in output


def _extract(commit: str, scratch: Path) -> Path:
    tree = scratch / commit[:12]
    tree.mkdir()
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def load_index() -> list[dict]:
    return json.loads(INDEX.read_text()) if INDEX.exists() else []


def main() -> int:
    index = load_index()
    present = {hashlib.sha256((CORPUS / e["file"]).read_text().encode()).hexdigest() for e in index}
    new = [c for c in candidates() if c.digest not in present]
    added, refused = [], []
    with tempfile.TemporaryDirectory() as scratch:
        trees: dict[str, Path] = {}
        for candidate in new:
            (added if checked_when_shipped(candidate, trees, Path(scratch)) else refused).append(candidate)
    for candidate in added:
        (CORPUS / candidate.filename).write_text(candidate.text)
        entry = {"file": candidate.filename, **asdict(candidate)}
        del entry["text"]
        index.append(entry)
    index.sort(key=lambda e: e["file"])
    INDEX.write_text(json.dumps(index, indent=1) + "\n")
    print(f"{len(added)} added, {len(refused)} not added (an error when shipped: a block showing a mistake), "
          f"{len(index)} in the corpus")
    for candidate in refused:
        print(f"  not added: {candidate.origin} @ {candidate.commit[:7]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
