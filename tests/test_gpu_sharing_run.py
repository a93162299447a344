"""`rldsl run` of pipelines that take turns on shared GPUs: the cluster's
lease scheduler actor governs them, and when it dies every pipeline stops
with an error naming it, its ledger balanced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from tests.test_supervision import _wait_for_steps, one_node_cluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = (ROOT / "pipelines" / "sim_shared_gpus.rlp").read_text()

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    yield from one_node_cluster(16, 4, "rldsl-a+b")  # the run's namespace: its pipelines are a and b


def test_a_dead_gpu_scheduler_stops_every_pipeline_with_a_named_error(cluster, tmp_path):
    source, run_dir = tmp_path / "shared.rlp", tmp_path / "run"
    source.write_text(SHARED.replace("steps = 8", "steps = 200"))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    process = subprocess.Popen([sys.executable, "-m", "rldsl", "run", str(source), "--address", cluster.address,
                                "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=ROOT, env=env)
    try:
        _wait_for_steps(run_dir / "a" / "metrics.jsonl", 2, process)
        ray.kill(ray.get_actor("gpu-scheduler"))
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 3, stderr[-3000:]
    assert "GPU lease scheduler actor `gpu-scheduler` died" in stderr
    assert "Traceback" not in stderr
    for name in ("a", "b"):
        summary = json.loads((run_dir / name / "summary.json").read_text())
        assert summary["exit"] == "failed" and "GPU lease scheduler" in summary["error"], name
        ledger = summary["ledger"]  # every sample accounted for: trained, dropped, or open when it stopped
        assert ledger["generated"] == ledger["trained"] + sum(ledger["dropped"].values()) + ledger["open"]
        assert 2 <= summary["steps"] < 200
        assert "did not answer" in summary["gpu_sharing"]["error"]  # the figures died with it, and it says so
