"""`rldsl report RUN_DIR`: one figure a user reads at a glance (report.png,
or with ``--html`` the same as one self-contained interactive page), and a
printed summary of the run.

data.py reads the run directory into series; png.py and html.py draw them.
"""

from __future__ import annotations

import sys
from pathlib import Path


def write_report(run_dir: Path, html: bool = False) -> int:
    if not (run_dir / "metrics.jsonl").exists():
        print(f"error: {run_dir} has no metrics.jsonl", file=sys.stderr)
        print("  = help: pass a directory written by `rldsl run` (see its last line)", file=sys.stderr)
        return 2
    from rldsl.report.data import ledger_of, number, read_json, read_metrics, report_data
    from rldsl.report.png import write_png

    steps, evals = read_metrics(run_dir)
    data = report_data(run_dir)
    written = [write_png(data, run_dir / "report.png")]
    if html:
        from rldsl.report.html import write_html

        written.append(write_html(data, run_dir / "report.html"))
    summary_path = run_dir / "summary.json"
    summary = read_json(summary_path)
    print(f"run: {run_dir}")
    print(f"steps: {len(steps)}" + _ending(summary, summary_path.exists()))
    ledger = ledger_of(summary)
    if ledger is not None:
        dropped = ", ".join(f"{k} {v:.0f}" for k, v in ledger["dropped"].items()) or "none"
        print(f"samples: generated {ledger['generated']:.0f}, trained {ledger['trained']:.0f}, dropped {dropped}")
        figures = [f"max lag: {summary.get('max_lag', 'unknown')}"]
        if "samples_per_s" in summary:  # the controller's figure: absent when it died
            figures.append(f"{number(summary['samples_per_s']):.1f} samples/s")
        print(", ".join(figures + [f"wall clock {number(summary.get('wall_clock_s')):.0f}s"]))
    if len(evals) == 1:  # no start and end to compare (run { eval_at_start  eval_at_end })
        print(f"held-out accuracy: {evals[0]['accuracy']:.3f} (step {evals[0]['step']}), the only evaluation")
    elif evals:
        first, last = evals[0], evals[-1]
        print(f"held-out accuracy: {first['accuracy']:.3f} (step {first['step']}) -> {last['accuracy']:.3f} "
              f"(step {last['step']}), {last['accuracy'] - first['accuracy']:+.3f}")
    rewards = [s["reward_mean"] for s in steps if s.get("reward_mean") is not None]
    if rewards:
        print(f"mean reward: {rewards[0]:.3f} (first step) -> {rewards[-1]:.3f} (last step)")
    for path in written:
        print(f"wrote {path}")
    return 0


def _ending(summary: dict, exists: bool) -> str:
    """How the run ended, when it did not simply finish (summary.json says so on every exit path)."""
    if not summary:
        return (" (summary.json is unreadable: the run was killed while writing it)" if exists
                else " (no summary.json: the run did not finish)")
    exit = summary.get("exit") or "finished"
    if exit == "finished":
        return ""
    how = f" by {summary['signal']}" if summary.get("signal") else ""
    return f" (the run {exit}{how}" + (f": {summary['error']}" if summary.get("error") else "") + ")"
