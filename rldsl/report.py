"""`rldsl report RUN_DIR`: a PNG of the reward and evaluation curves, and a
printed summary of the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step records, eval records) from metrics.jsonl; a resumed run's
    repeated steps keep their latest record."""
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        (evals if record.get("eval") else steps)[record["step"]] = record
    return [steps[k] for k in sorted(steps)], [evals[k] for k in sorted(evals)]


def plot(steps: list[dict], evals: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    rewarded = [s for s in steps if s.get("reward_mean") is not None]
    top.plot([s["step"] for s in rewarded], [s["reward_mean"] for s in rewarded], color="tab:blue")
    top.set_ylabel("mean reward (sampled)")
    top.grid(alpha=0.3)
    bottom.plot([e["step"] for e in evals], [e["accuracy"] for e in evals], marker="o", color="tab:green")
    bottom.set_ylabel("held-out accuracy (greedy)")
    bottom.set_xlabel("step")
    bottom.set_ylim(0, 1)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(run_dir: Path) -> int:
    if not (run_dir / "metrics.jsonl").exists():
        print(f"error: {run_dir} has no metrics.jsonl", file=sys.stderr)
        print("  = help: pass a directory written by `rldsl run` (see its last line)", file=sys.stderr)
        return 2
    steps, evals = read_metrics(run_dir)
    png = run_dir / "report.png"
    plot(steps, evals, png)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    print(f"run: {run_dir}")
    print(f"steps: {len(steps)}" + ("" if summary else " (no summary.json: the run did not finish)"))
    if summary:
        ledger = summary["ledger"]
        dropped = ", ".join(f"{k} {v}" for k, v in ledger["dropped"].items()) or "none"
        print(f"samples: generated {ledger['generated']}, trained {ledger['trained']}, dropped {dropped}")
        print(f"max lag: {summary['max_lag']}, {summary['samples_per_s']:.1f} samples/s, "
              f"wall clock {summary.get('wall_clock_s', 0):.0f}s")
    if evals:
        first, last = evals[0], evals[-1]
        print(f"held-out accuracy: {first['accuracy']:.3f} (step {first['step']}) -> {last['accuracy']:.3f} "
              f"(step {last['step']}), {last['accuracy'] - first['accuracy']:+.3f}")
    rewards = [s["reward_mean"] for s in steps if s.get("reward_mean") is not None]
    if rewards:
        print(f"mean reward: {rewards[0]:.3f} (first step) -> {rewards[-1]:.3f} (last step)")
    print(f"wrote {png}")
    return 0
