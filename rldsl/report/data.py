"""What a report shows, read from a run directory (metrics.jsonl,
summary.json, plan.json, trace.json), as plain series both renderers use."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

_TIME_BINS = 120
_NOT_STAGES = ("controller", "evaluator")  # their tracks are not stage work
NESTED_PREFIX = "dataplane"  # spans inside a stage call (its data-plane reads and writes)


@dataclass
class Series:
    x: list[float]
    y: list[float]


@dataclass
class ReportData:
    title: str
    subtitle: str
    curves: dict[str, Series] = field(default_factory=dict)  # panel name -> per-step series
    lag_histogram: dict[int, int] = field(default_factory=dict)
    stage_busy: dict[str, Series] = field(default_factory=dict)  # stage -> busy share over run time (s)
    gpu_busy: dict[str, list[float]] = field(default_factory=dict)  # "GPU n:g" -> busy share per time bin
    time_edges: list[float] = field(default_factory=list)  # seconds, len(bins) + 1
    timeline: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)  # track -> (start, dur, name)


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step records, eval records) from metrics.jsonl; a repeated step
    keeps its latest record, and a line a killed run left torn is skipped."""
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        if record.get("eval") and not isinstance(record.get("accuracy"), (int, float)):
            continue
        (evals if record.get("eval") else steps)[record["step"]] = record
    return [steps[k] for k in sorted(steps)], [evals[k] for k in sorted(evals)]


def read_json(path: Path) -> dict:
    """The file's object; {} when it is missing, unreadable or not a JSON object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def number(value, default: float = 0.0) -> float:
    """A figure of summary.json, which a run that died may have left out."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def ledger_of(summary: dict) -> dict | None:
    """summary.json's whole-run ledger with the counts the report prints, or None."""
    ledger = summary.get("ledger")
    if not isinstance(ledger, dict):
        return None
    dropped = ledger.get("dropped") if isinstance(ledger.get("dropped"), dict) else {}
    return {"generated": number(ledger.get("generated")), "trained": number(ledger.get("trained")),
            "dropped": {str(k): number(v) for k, v in dropped.items()}}


def report_data(run_dir: Path) -> ReportData:
    steps, evals = read_metrics(run_dir)
    summary = read_json(run_dir / "summary.json")
    trace = read_json(run_dir / "trace.json")
    pipeline = (summary.get("pipeline") or _pipeline_name(run_dir) or trace.get("otherData", {}).get("pipeline")
                or run_dir.name)
    data = ReportData(f"{pipeline} — {run_dir.name}", _subtitle(steps, summary))
    data.curves = _curves(steps, evals)
    for record in steps:
        histogram = record.get("lag_histogram")
        for lag, count in (histogram.items() if isinstance(histogram, dict) else ()):
            if str(lag).lstrip("-").isdigit() and isinstance(count, int):
                data.lag_histogram[int(lag)] = data.lag_histogram.get(int(lag), 0) + count
    if isinstance(trace.get("traceEvents"), list):
        try:
            _add_trace(data, trace["traceEvents"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a trace cut short: the panels without it
            data.stage_busy, data.gpu_busy, data.time_edges, data.timeline = {}, {}, [], {}
    return data


def _pipeline_name(run_dir: Path) -> str:
    """The pipelines of the run's plan.json ('' without one)."""
    plan = read_json(run_dir / "plan.json")
    return "+".join(p["name"] for p in plan.get("pipelines", []))


def _subtitle(steps: list[dict], summary: dict) -> str:
    ledger = ledger_of(summary)
    if ledger is None:
        return f"{len(steps)} steps (no summary.json with a ledger: the run did not finish)"
    parts = [f"{summary.get('steps', len(steps))} steps",
             f"{ledger['trained']:.0f} samples trained ({sum(ledger['dropped'].values()):.0f} dropped)"]
    if "max_lag" in summary:
        parts.append(f"max lag {summary['max_lag']}")
    if "samples_per_s" in summary:
        parts.append(f"{number(summary['samples_per_s']):.1f} samples/s")
    return ", ".join(parts) + f", wall clock {number(summary.get('wall_clock_s')):.0f} s"


def _curves(steps: list[dict], evals: list[dict]) -> dict[str, Series]:
    def per_step(value) -> Series:
        points = [(s["step"], value(s)) for s in steps]
        points = [(x, y) for x, y in points if isinstance(y, (int, float))]
        return Series([x for x, _ in points], [y for _, y in points])

    def trainer(name):
        return lambda s: s.get("trainer", {}).get(name)

    def rate(count):
        return lambda s: count(s) / s["step_time_s"] if count(s) is not None and s.get("step_time_s") else None

    curves = {
        "reward (sampled)": per_step(lambda s: s.get("reward_mean")),
        "held-out accuracy (greedy)": Series([e["step"] for e in evals], [e["accuracy"] for e in evals]),
        "KL to the reference": per_step(trainer("kl")),
        "response length (tokens)": per_step(lambda s: _ratio(trainer("tokens")(s), trainer("sequences")(s))),
        "gradient norm": per_step(trainer("grad_norm")),
        "samples/s": per_step(rate(lambda s: s.get("samples"))),
        "tokens/s": per_step(rate(trainer("tokens"))),
        "generator/trainer mismatch: KL(behaviour || proximal)": per_step(trainer("mismatch_kl")),
        "generator/trainer mismatch: largest p_prox / p_behaviour": per_step(trainer("mismatch_ratio_max")),
        "generator/trainer on the same weights: mean |log p difference|": per_step(trainer("mismatch/abs_diff_mean")),
        "generator/trainer on the same weights: largest |log p difference|": per_step(trainer("mismatch/abs_diff_max")),
    }
    if any(s.get("trainer", {}).get("capped_fraction") for s in steps):  # a correction acted
        curves["tokens truncated or masked by the correction (share)"] = per_step(trainer("capped_fraction"))
    for part in dict.fromkeys(name for s in steps for name in s.get("reward_components") or {}):
        curves[f"reward: {part}"] = per_step(lambda s, part=part: (s.get("reward_components") or {}).get(part))
    for stat in dict.fromkeys(name for s in steps for name in s.get("episode_stats") or {}):
        curves[f"episodes: {stat}"] = per_step(lambda s, stat=stat: (s.get("episode_stats") or {}).get(stat))
    return {name: series for name, series in curves.items() if series.x}


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _add_trace(data: ReportData, events: list[dict]) -> None:
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        return
    end = max(e["ts"] + e["dur"] for e in spans) / 1e6
    width = max(end / _TIME_BINS, 1e-3)
    data.time_edges = [i * width for i in range(_TIME_BINS + 1)]
    stage_tracks: dict[str, dict[int, list]] = {}
    gpu_tracks: dict[str, list] = {}
    for e in spans:
        interval = (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        if e["cat"] == "gpu":
            gpu_tracks.setdefault(names[e["pid"]], []).append(interval)
        elif e["cat"] not in _NOT_STAGES:
            stage = names[e["pid"]].removeprefix("stage ")
            stage_tracks.setdefault(stage, {}).setdefault(e["tid"], []).append(interval)
            data.timeline.setdefault(e["args"].get("actor", stage), []).append(
                (interval[0], interval[1] - interval[0], e["name"]))
    centres = [(a + b) / 2 for a, b in zip(data.time_edges, data.time_edges[1:])]
    for stage, actors in sorted(stage_tracks.items()):
        shares = [_binned(intervals, data.time_edges) for intervals in actors.values()]
        data.stage_busy[stage] = Series(centres, [sum(col) / len(shares) for col in zip(*shares)])
    for gpu, intervals in sorted(gpu_tracks.items()):
        data.gpu_busy[gpu] = _binned(intervals, data.time_edges)


def _binned(intervals: list[tuple[float, float]], edges: list[float]) -> list[float]:
    """Share of each (equal-width) time bin covered by the union of ``intervals``."""
    width = edges[1] - edges[0]
    covered = [0.0] * (len(edges) - 1)
    merged: list[list[float]] = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    for start, stop in merged:
        first, last = int(start // width), min(int(stop // width), len(covered) - 1)
        for index in range(first, last + 1):
            covered[index] += max(0.0, min(stop, edges[index + 1]) - max(start, edges[index]))
    return [min(1.0, c / width) for c in covered]
