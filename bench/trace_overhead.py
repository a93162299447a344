"""What the run's trace costs: the default pipeline with tracing on and off.

Runs pipelines/grpo_async.rlp through `rldsl run`, interleaving runs with
RLDSL_TRACE=1 (the default) and RLDSL_TRACE=0, and prints each run's
training-loop time and samples/s, the median ratio, and a floor estimate
from first principles: spans recorded per step x the measured cost of one
span, against the step time.

    python bench/trace_overhead.py [--runs 2] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rldsl.runtime.ray_lowering.trace import Tracer

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = ROOT / "pipelines" / "grpo_async.rlp"


def run(steps: int, run_dir: Path, traced: bool) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RLDSL_TRACE": "1" if traced else "0"}
    subprocess.run([sys.executable, "-m", "rldsl", "run", str(PIPELINE), "--steps", str(steps), "--run-dir",
                    str(run_dir)], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    spans = 0
    if traced:
        spans = sum(e["ph"] == "X" and e["cat"] != "gpu"
                    for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"])
    return {"loop_s": summary["train_loop_s"], "samples_per_s": summary["samples_per_s"], "spans": spans,
            "steps": summary["steps"]}


def span_cost_s(count: int = 200_000) -> float:
    tracer = Tracer("bench", "bench", "generate", 0, [0], 0)
    started = time.perf_counter()
    for index in range(count):
        with tracer.span("generate", groups=[index], version=0):
            pass
    return (time.perf_counter() - started) / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2, help="runs per setting, interleaved")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    results: dict[bool, list[dict]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.runs):
            for traced in (True, False):
                result = run(args.steps, Path(tmp) / f"{index}-{traced}", traced)
                results[traced].append(result)
                print(f"run {index + 1} trace {'on ' if traced else 'off'}: training loop {result['loop_s']:.1f} s, "
                      f"{result['samples_per_s']:.1f} samples/s" + (f", {result['spans']} spans" if traced else ""),
                      flush=True)
    on = statistics.median(r["loop_s"] for r in results[True])
    off = statistics.median(r["loop_s"] for r in results[False])
    print(f"median training loop: trace on {on:.1f} s, off {off:.1f} s: on/off {on / off:.3f} "
          f"({(on / off - 1):+.1%}; run-to-run noise included)")
    cost = span_cost_s()
    spans_per_step = statistics.median(r["spans"] / r["steps"] for r in results[True])
    step_s = off / args.steps
    print(f"one span costs {cost * 1e6:.2f} us; {spans_per_step:.0f} spans per step x {cost * 1e6:.2f} us = "
          f"{spans_per_step * cost * 1e3:.2f} ms of a {step_s * 1e3:.0f} ms step: "
          f"{spans_per_step * cost / step_s:.3%} (spread over the actors recording them)")


if __name__ == "__main__":
    main()
