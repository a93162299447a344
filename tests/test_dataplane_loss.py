"""The data plane supervised like any actor: a TransferQueue storage unit
killed mid-run (as a pre-empted node or an OOM would end it) is named within
seconds, the run stops with exit 3 and how to resume, and summary.json and
the journal account for every sample (trained, dropped or left open)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from tests.runs import lean_chaos, release_shared_ray  # noqa: E402
from tests.test_supervision import CHAOS, ROOT  # noqa: E402

NAMED_WITHIN_S = 10.0
STORAGE_UNIT = "TransferQueueStorageUnit#0"


@pytest.fixture
def cluster():
    """A one-node Ray cluster of its own (its TransferQueue is killed), this
    process connected to it in the run's namespace to find the storage unit."""
    release_shared_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 12, "num_gpus": 3})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="rldsl-chaos")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _wait_for_steps(metrics, steps: int, process: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the run ended before the kill: {process.stderr.read()[-3000:]}")
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError("the run did not reach its step")


class StderrLines:
    """A process's stderr, each line with the time it arrived."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stderr:
            self.lines.append((time.monotonic(), line))

    def first(self, text: str) -> float | None:
        return next((at for at, line in self.lines if text in line), None)

    def text(self) -> str:
        self._thread.join(timeout=10)
        return "".join(line for _, line in self.lines)


@pytest.mark.ray
@pytest.mark.own_ray
def test_a_killed_storage_unit_is_named_within_seconds(cluster, tmp_path):
    source, run_dir = tmp_path / "chaos.rlp", tmp_path / "run"
    source.write_text(lean_chaos(CHAOS).replace("steps = 600", "steps = 400").replace("checkpoint_every = 25",
                                                                          "checkpoint_every = 2"))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    process = subprocess.Popen([sys.executable, "-m", "rldsl", "run", str(source), "--address", cluster.address,
                                "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=ROOT, env=env)
    stderr = StderrLines(process)
    try:
        _wait_for_steps(run_dir / "metrics.jsonl", 3, process)
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(STORAGE_UNIT))
        process.wait(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
    err = stderr.text()
    named_at = stderr.first(f"the data plane's storage unit {STORAGE_UNIT} died")
    assert named_at is not None, err[-4000:]
    print(f"the storage unit's loss was named {named_at - killed_at:.1f}s after the kill")
    assert named_at - killed_at < NAMED_WITHIN_S, err[-4000:]
    assert process.returncode == 3, err[-4000:]
    assert "Traceback" not in err and "= help:" in err and "--resume" in err
    assert "no progress for" not in err  # not the watchdog's stall

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit"] == "failed" and STORAGE_UNIT in summary["error"]
    ledger = summary["ledger"]
    assert ledger["generated"] == ledger["trained"] + sum(ledger["dropped"].values()) + ledger["open"]
    audit = subprocess.run([sys.executable, "-m", "rldsl", "audit", str(run_dir)], capture_output=True, text=True,
                           cwd=ROOT)
    assert audit.returncode == 0, audit.stdout + audit.stderr
