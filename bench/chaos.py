"""A sim pipeline that loses actors while it runs, and what that cost.

    python bench/chaos.py [--steps 300] [--every 20] [--seed 0]

A local multi-actor Ray cluster (ray.cluster_utils) runs a sim pipeline
(two generator replicas, two reward workers, a frozen reference, one
trainer; a checkpoint every 25 steps) through `rldsl run --address`; once
it trains, every ``--every`` seconds a generator, reward or reference actor
is killed with ``ray.kill`` (the roles in turn, a random rank of each), and
the trainer once, after the fourth kill: the run restarts itself from its
last checkpoint and the kills go on.
Prints: exit code, steps, samples generated / trained / lost
(dropped as ``worker_died``), the recoveries' times, and whether `rldsl
audit` passes on the run directory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "rldsl-chaos"
VICTIM_STAGES = ("rollout", "score", "reference")
PIPELINE = ROOT / "pipelines" / "sim_chaos.rlp"  # its checkpoint every 25 steps lets the trainer restart
TRAINER_AFTER = 4  # stateless kills before the trainer's; then the run restarts from its last checkpoint



def start(address: str, source: Path, run_dir: Path) -> subprocess.Popen:
    """The run, its output in ``run_dir``.log (a pipe nobody reads would fill and stall it)."""
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - the child holds it for its lifetime
    return subprocess.Popen([sys.executable, "-m", "rldsl", "run", str(source), "--run-dir", str(run_dir),
                             "--address", address],
                            stdout=subprocess.DEVNULL, stderr=log, text=True, cwd=ROOT,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})


def living_victims(ray) -> list[str]:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    return sorted(n for n in names if n.split("-")[0] in (*VICTIM_STAGES, "actor"))


def steps_done(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return sum(1 for line in metrics.read_text().splitlines() if '"step"' in line) if metrics.exists() else 0


def kill_until_done(ray, process: subprocess.Popen, run_dir: Path, every_s: float, rng: random.Random) -> list[str]:
    """Kills start once the run trains: a stage that dies while starting fails the run by design."""
    while process.poll() is None and steps_done(run_dir) < 1:
        time.sleep(0.2)
    killed, next_kill = [], time.monotonic() + every_s
    roles = itertools.cycle(VICTIM_STAGES)  # each role in turn, a random rank of it
    while process.poll() is None:
        time.sleep(0.5)
        if time.monotonic() >= next_kill:
            role = "actor" if len(killed) == TRAINER_AFTER else next(roles)
            victims = [name for name in living_victims(ray) if name.split("-")[0] == role]
            if victims:
                victim = rng.choice(victims)
                try:
                    ray.kill(ray.get_actor(victim, namespace=NAMESPACE))
                    killed.append(victim)
                    print(f"  t={time.strftime('%H:%M:%S')} killed {victim}", flush=True)
                except ValueError:  # it died or was replaced between the listing and the kill
                    pass
                if role == "actor":
                    wait_for_restart(process, run_dir)
            next_kill = time.monotonic() + every_s
    return killed


def wait_for_restart(process: subprocess.Popen, run_dir: Path) -> None:
    """Until the restarted run trains again: an actor killed while it starts fails the run by design."""
    log = run_dir.with_suffix(".log")
    while process.poll() is None and "restarting" not in log.read_text():
        time.sleep(0.2)
    restarted_at = steps_done(run_dir)
    while process.poll() is None and steps_done(run_dir) <= restarted_at:
        time.sleep(0.2)


def report(name: str, process: subprocess.Popen, run_dir: Path, seconds: float) -> dict:
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    ledger = summary.get("ledger", {})
    recoveries = summary.get("recoveries", [])
    print(f"{name}: exit {process.returncode} after {seconds:.0f}s; steps {summary.get('steps', steps_done(run_dir))}; "
          f"generated {ledger.get('generated', '?')}, trained {ledger.get('trained', '?')}, "
          f"lost (worker_died) {ledger.get('dropped', {}).get('worker_died', 0)}, "
          f"dropped {sum(ledger.get('dropped', {}).values()) if ledger else '?'}")
    if recoveries:
        times = sorted(r["seconds"] for r in recoveries)
        print(f"  {len(recoveries)} recoveries, replacement time min {times[0]:.1f}s / median "
              f"{times[len(times) // 2]:.1f}s / max {times[-1]:.1f}s")
    said = ("error", "  = ", "restarting", "recovered")
    for line in [line for line in run_dir.with_suffix(".log").read_text().splitlines() if line.startswith(said)]:
        print(f"  {line}")
    audit = subprocess.run([sys.executable, "-m", "rldsl", "audit", str(run_dir)], capture_output=True, text=True,
                           cwd=ROOT)
    verdict = "passes" if audit.returncode == 0 else f"FAILS (exit {audit.returncode})"
    print(f"  rldsl audit {verdict}: " + " | ".join(audit.stdout.strip().splitlines()[:3]))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=float, default=20.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    rng = random.Random(args.seed)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 12, "num_gpus": 3})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="chaos-bench")
    work = Path(tempfile.mkdtemp(prefix="rldsl-chaos-"))
    try:
        source, run_dir = work / "chaos.rlp", work / "run"
        source.write_text(PIPELINE.read_text().replace("steps = 600", f"steps = {args.steps}"))
        print(f"{args.steps} steps, checkpoint every 25; a {'/'.join(VICTIM_STAGES)} actor killed "
              f"every {args.every:.0f}s, and the trainer once after the {TRAINER_AFTER}th kill")
        started = time.monotonic()
        process = start(cluster.address, source, run_dir)
        kill_until_done(ray, process, run_dir, args.every, rng)
        report("chaos run", process, run_dir, time.monotonic() - started)
        print(f"run directory: {run_dir}")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
