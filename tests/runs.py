"""Running the `rldsl` command from a test, as a user would, in the repository root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rldsl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m rldsl ARGS`` in the repository root, output captured."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "rldsl", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


def run_text(tmp_path: Path, text: str, *args: str, name: str = "p.rlp", timeout: float = 600):
    """``rldsl run`` of a pipeline written as ``text``, which must succeed:
    (the finished process, its run directory, its summary.json)."""
    source, run_dir = tmp_path / name, tmp_path / "run"
    source.write_text(text)
    run = rldsl("run", str(source), "--run-dir", str(run_dir), *args, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, run_dir, json.loads((run_dir / "summary.json").read_text())
