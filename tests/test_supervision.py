"""An actor killed mid-run (``ray.kill``, as a pre-empted node or an OOM
would end it): generator, reward and logprob actors are replaced and the
run finishes with every sample accounted for; a lost trainer rank ends the
run with a named error and exit code 3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

STEPS = 10
CHAOS = (ROOT / "pipelines" / "sim_chaos.rlp").read_text()


def one_node_cluster(num_cpus: int, num_gpus: int, namespace: str):
    """A one-node Ray cluster with logical GPUs, this process connected to it
    in the run's namespace (to find its actors by name); shut down after."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus, "num_gpus": num_gpus})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=namespace)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def cluster():
    yield from one_node_cluster(12, 3, "rldsl-chaos")


def run_and_kill(cluster, tmp_path: Path, victim: str, checkpoint_every: int = 0, text: str | None = None
                 ) -> tuple[subprocess.CompletedProcess, Path]:
    """`rldsl run` on the cluster; ``victim`` (an actor name) killed once two steps are done."""
    source, run_dir = tmp_path / "chaos.rlp", tmp_path / "run"
    source.write_text(text or CHAOS.replace("steps = 600", f"steps = {STEPS}")
                      .replace("checkpoint_every = 25", f"checkpoint_every = {checkpoint_every}"))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    process = subprocess.Popen([sys.executable, "-m", "rldsl", "run", str(source), "--address", cluster.address,
                                "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=ROOT, env=env)
    try:
        _wait_for_steps(run_dir / "metrics.jsonl", 2, process)
        ray.kill(ray.get_actor(victim))
        stdout, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), run_dir


def _wait_for_steps(metrics: Path, steps: int, process: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the run ended before the kill: {process.stderr.read()[-3000:]}")
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError("the run did not reach its second step")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("victim", ["rollout-1", "score-0", "reference-0"])
def test_a_killed_stateless_actor_is_replaced_and_the_run_finishes(cluster, tmp_path, victim):
    result, run_dir = run_and_kill(cluster, tmp_path, victim)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"recovered: {victim} died" in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert [r["stage"] + "-" + str(r["rank"]) for r in summary["recoveries"]] == [victim]
    ledger = summary["ledger"]
    assert ledger["open"] == 0
    assert ledger["trained"] + sum(ledger["dropped"].values()) == ledger["generated"]
    assert ledger["trained"] >= STEPS * 4 * 4 - 4 * 4  # at most the groups in flight were lost
    audit = subprocess.run([sys.executable, "-m", "rldsl", "audit", str(run_dir)], capture_output=True, text=True,
                           cwd=ROOT)
    assert audit.returncode == 0, audit.stdout + audit.stderr


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_trainer_rank_without_a_checkpoint_ends_the_run_with_a_named_error(cluster, tmp_path):
    result, run_dir = run_and_kill(cluster, tmp_path, "actor-0")
    assert result.returncode == 3, result.stderr[-3000:]
    assert "trainer rank 0 of `actor` died" in result.stderr
    assert "Traceback" not in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit"] == "failed" and "trainer rank 0" in summary["error"]
    audit = subprocess.run([sys.executable, "-m", "rldsl", "audit", str(run_dir)], capture_output=True, text=True,
                           cwd=ROOT)
    assert audit.returncode == 0, audit.stdout + audit.stderr  # what did happen is consistent, if unfinished


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_trainer_rank_restarts_the_run_from_its_last_checkpoint(cluster, tmp_path):
    result, run_dir = run_and_kill(cluster, tmp_path, "actor-0", checkpoint_every=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restarting every actor from v" in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["exit"] == "finished"
    audit = subprocess.run([sys.executable, "-m", "rldsl", "audit", str(run_dir)], capture_output=True, text=True,
                           cwd=ROOT)
    assert audit.returncode == 0, audit.stdout + audit.stderr  # nothing trained twice across the restart


# ---------------------------------------------------------------- the control plane's side, in process


def test_a_generator_replica_that_cannot_be_replaced_is_retired_and_the_run_goes_on():
    import dataclasses

    from rldsl.runtime.control.errors import WorkerLost
    from rldsl.runtime.engines.sim import Latency
    from rldsl.runtime.inprocess import SimConfig
    from tests.test_controller import make_settings, run_controller

    settings = make_settings(prompts_per_step=4, samples_per_prompt=2, steps=4, max_lag=1)
    config = SimConfig(generate=Latency.constant(0.002), generators=2, microbatch=Latency.constant(0.002))
    calls_after_loss = []

    def wrap(handles):
        async def generate(replica, *args):
            if replica == 1:
                calls_after_loss.append(replica)
                raise WorkerLost("rollout", 1, "ActorDiedError: killed", replica=1)
            return await handles.generate(replica, *args)

        return dataclasses.replace(handles, generate=generate)

    summary, _, _ = run_controller(settings, config, wrap=wrap)
    assert summary["steps"] == 4
    ledger = summary["ledger"]
    assert ledger["open"] == 0 and ledger["dropped"].get("worker_died", 0) == 2  # the one group sent to it
    assert calls_after_loss == [1]  # retired after its loss: nothing more is sent to it


TORCH_WITH_EVALUATION = """
pipeline chaos
cluster { nodes = 1  gpus_per_node = 2 }
model policy { source = "builtin:tiny-lm" }
dataset prompts { source = "builtin:arith"  eval_size = 16 }
stage generate rollout { model = policy  engine = torch  gpus = 1  samples_per_prompt = 4  max_new_tokens = 8 }
stage reward score { fn = "rldsl.rewards:exact_match" }
stage train actor { model = policy  engine = torch  gpus = 1  prompts_per_step = 4  micro_batch = 4 }
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> actor
staleness { max_lag = 1 }
run { steps = 8  eval_every = 2  watchdog = 120s }
"""


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_evaluator_is_replaced_and_evaluation_goes_on(cluster, tmp_path):
    result, run_dir = run_and_kill(cluster, tmp_path, "evaluator", text=TORCH_WITH_EVALUATION)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recovered: the evaluator died" in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["evals"][-1]["step"] == 8  # the final evaluation still ran
