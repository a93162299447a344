"""Where a short `rldsl run` spends its time: the start-up phases against the
training loop, for a run of a few steps (a newcomer's first try).

    python bench/startup.py [--pipeline pipelines/grpo_async.rlp] [--steps 2] [--repeat 2]

Each repetition runs `rldsl run` in a fresh interpreter, as a user starts it,
with the driver's phases timed from outside the code (wrappers installed
before `rldsl.cli.main`): the driver's imports, Ray's start, the data
plane (TransferQueue), the model (the builtin warm start, cached after the
first run), the actors' creation and readiness (each imports torch, Ray and
TransferQueue's tensordict), the training loop (the controller's steps, the
final evaluation and checkpoint), the teardown (actors, TransferQueue and
Ray stopped) and the rest (compiling the file, placement groups and their
check, the interpreter's own start and end). Prints one row per repetition and the phases' means; the warm
start's first build shows in the first row only."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs in the child: times the driver's phases with wrappers, then runs the CLI.
CHILD = r"""
import functools, json, sys, time
started = float(sys.argv[1])
marks = {"imports": None}
from rldsl.runtime.ray_lowering import cluster, driver, pipeline_driver
marks["imports"] = time.time() - started
spent = {}

def timed(owner, name, phase):
    original = getattr(owner, name)
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        begun = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            spent[phase] = spent.get(phase, 0.0) + time.time() - begun
            marks[phase + "_end"] = time.time()
    setattr(owner, name, wrapper)

run_driver = next(v for v in vars(driver).values() if isinstance(v, type) and hasattr(v, "_drive"))
timed(cluster, "start_ray", "ray")
timed(driver, "_dataplane", "dataplane")
timed(pipeline_driver.PipelineDriver, "prepare_models", "model")
timed(pipeline_driver.PipelineDriver, "create_actors", "actors")
timed(driver, "_wait_ready", "actors")
timed(run_driver, "_drive", "training")
from rldsl.cli import main
code = main(sys.argv[2:])
spent["teardown"] = time.time() - marks["training_end"]  # the session's exit: actors, TransferQueue, Ray
print("PHASES " + json.dumps({"imports": marks["imports"], **spent}), file=sys.stderr)
sys.exit(code)
"""

PHASES = ("imports", "ray", "dataplane", "model", "actors", "training", "teardown", "other")


def one_run(pipeline: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.time()
        done = subprocess.run([sys.executable, "-c", CHILD, str(started), "run", pipeline, "--steps", str(steps),
                               "--run-dir", str(Path(tmp) / "run")], cwd=ROOT, capture_output=True, text=True)
        total = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    line = next(line for line in done.stderr.splitlines() if line.startswith("PHASES "))
    phases = json.loads(line.removeprefix("PHASES "))
    # what is left: compiling the file, the placement groups and their check, the restore, the
    # interpreter's own start and end
    phases["other"] = max(0.0, total - sum(phases.get(p, 0.0) for p in PHASES if p != "other"))
    return {"total": total, **{p: phases.get(p, 0.0) for p in PHASES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", default="pipelines/grpo_async.rlp")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    rows = [one_run(args.pipeline, args.steps) for _ in range(args.repeat)]
    print(f"{args.pipeline}, {args.steps} steps: seconds per phase")
    print("| run | total | " + " | ".join(PHASES) + " |")
    print("|---|" + "---:|" * (len(PHASES) + 1))
    for index, row in enumerate(rows, 1):
        print(f"| {index} | {row['total']:.1f} | " + " | ".join(f"{row[p]:.1f}" for p in PHASES) + " |")
    mean = {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}
    print(f"| mean | {mean['total']:.1f} | " + " | ".join(f"{mean[p]:.1f}" for p in PHASES) + " |")


if __name__ == "__main__":
    main()
