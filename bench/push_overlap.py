"""Pushes off the trainer's critical path: how much of each rank-to-rank
push the trainer spends training the next step, read from a run's trace.

Runs the default pipeline with two generator replicas fed by a collective
sync (`transport = collective`, gloo on a CPU, 64 KiB buckets), then reads
its trace.json: each push is the trainer's `weight export` span; the
microbatches (`train_microbatch`) that start inside it, and the trainer's
training time inside it, are the work a push used to hold back (read on
the trainer's first rank). Also printed: the mean push, the mean step time
and the samples per second. `--trainer fsdp`: two fsdp ranks train instead
of one torch rank.

    python bench/push_overlap.py [--steps 8] [--trainer torch|fsdp] [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pipeline(steps: int, trainer: str) -> str:
    from tests.test_weight_transport_run import collective_pipeline

    return collective_pipeline(eval_size=0, trainer=trainer).replace("steps = 4", f"steps = {steps}")


def spans(events: list[dict], name: str, **args) -> list[tuple[int, int]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e["ph"] == "X" and e["name"] == name and e.get("cat") != "gpu"
                  and all(e["args"].get(k) == v for k, v in args.items()))


def report(run_dir: Path) -> None:
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    pushes = spans(events, "weight export", transport="collective", actor="actor-0")
    microbatches = spans(events, "train_microbatch", actor="actor-0")
    pushing = sum(end - start for start, end in pushes)
    training = sum(max(0, min(e, end) - max(s, start)) for start, end in pushes for s, e in microbatches)
    started = [sum(start < s < end for s, _ in microbatches) for start, end in pushes]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_times = [s["step_time_s"] for s in steps if "step_time_s" in s]
    print(f"pushes: {len(pushes)}, mean {pushing / max(1, len(pushes)) / 1e3:.0f} ms")
    print(f"trainer training inside pushes: {training / 1e3:.0f} of {pushing / 1e3:.0f} ms "
          f"({training / max(1, pushing):.0%})")
    print(f"microbatches started during each push: {started}")
    print(f"mean step time: {sum(step_times) / max(1, len(step_times)):.3f} s, "
          f"samples/s: {steps[-1].get('samples_per_s', 0):.1f}" if steps else "no steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--trainer", choices=("torch", "fsdp"), default="torch")
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="push-overlap-"))
    run_dir = args.run_dir or work / "run"
    source = work / "collective.rlp"
    source.write_text(pipeline(args.steps, args.trainer))
    proc = subprocess.run([sys.executable, "-m", "rldsl.cli", "run", str(source), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"the run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report(run_dir)


if __name__ == "__main__":
    main()
