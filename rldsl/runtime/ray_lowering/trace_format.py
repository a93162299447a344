"""The collected spans as a Chrome trace-event file (Perfetto, chrome://tracing).

Tracks: one process per stage with a thread per actor (plus the controller
and the evaluator), and one process per GPU with a thread per actor that
runs on it, so a GPU's idle gaps show at a glance. Flow arrows lead from
the generate call that produced a prompt group to the train microbatch
that consumed it.
"""

from __future__ import annotations

import json
from pathlib import Path

_GPU_PID_BASE = 1000
_FLOW_SOURCES = ("generate",)
_FLOW_SINKS = ("train_microbatch",)


def write_chrome_trace(events_path: Path, trace_path: Path, pipeline: str) -> Path | None:
    if not events_path.exists():
        return None
    batches = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    trace_path.write_text(json.dumps(chrome_trace(batches, pipeline)) + "\n")
    return trace_path


def chrome_trace(batches: list[dict], pipeline: str) -> dict:
    actors: dict[str, dict] = {}
    spans: list[tuple[str, tuple]] = []
    for batch in batches:
        meta = batch["actor"]
        actors[meta["actor"]] = meta
        spans.extend((meta["actor"], tuple(event)) for event in batch["events"])
    start = min((event[1] for _, event in spans), default=0)
    stage_tracks, gpu_tracks, out = _tracks(actors)
    for actor, (name, ts, dur, args) in sorted(spans, key=lambda s: s[1][1]):
        meta = actors[actor]
        span_args = {k: v for k, v in {**args, "actor": actor, "rank": meta["rank"], "node": meta["node"],
                                       "gpus": meta["gpus"]}.items() if v is not None}
        event = {"name": name, "cat": meta["kind"], "ph": "X", "ts": ts - start, "dur": dur, "args": span_args}
        pid, tid = stage_tracks[actor]
        out.append({**event, "pid": pid, "tid": tid})
        for gpu in meta["gpus"]:
            gpid, gtid = gpu_tracks[(meta["node"], gpu, actor)]
            out.append({**event, "cat": "gpu", "pid": gpid, "tid": gtid})
        if name in _FLOW_SOURCES or name in _FLOW_SINKS:
            phase = {"ph": "s"} if name in _FLOW_SOURCES else {"ph": "f", "bp": "e"}
            for group in args.get("groups", ()):
                out.append({"name": "prompt group", "cat": "group", "id": int(group), "ts": ts - start + 1,
                            "pid": pid, "tid": tid, **phase})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"pipeline": pipeline, "start_unix_us": start, "format": "rldsl trace 1"}}


def _tracks(actors: dict[str, dict]) -> tuple[dict, dict, list[dict]]:
    """(actor -> (pid, tid) of its stage track, (node, gpu, actor) -> (pid, tid)
    of its GPU track, the naming metadata events)."""
    stages = sorted({m["stage"] for m in actors.values()}, key=_stage_order(actors))
    stage_pid = {stage: index + 1 for index, stage in enumerate(stages)}
    meta_events: list[dict] = []
    for stage, pid in stage_pid.items():
        meta_events += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"stage {stage}"}},
                        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
    stage_tracks = {}
    for actor, meta in sorted(actors.items(), key=lambda kv: (kv[1]["stage"], kv[1]["rank"] or 0)):
        pid, tid = stage_pid[meta["stage"]], (meta["rank"] or 0) + 1
        stage_tracks[actor] = (pid, tid)
        meta_events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                            "args": {"name": _describe(actor, meta)}})
    gpus = sorted({(m["node"], g) for m in actors.values() for g in m["gpus"]})
    gpu_pid = {gpu: _GPU_PID_BASE + index for index, gpu in enumerate(gpus)}
    for (node, gpu), pid in gpu_pid.items():
        meta_events += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"GPU {node}:{gpu}"}},
                        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
    gpu_tracks = {}
    for (node, gpu), pid in gpu_pid.items():
        residents = sorted(a for a, m in actors.items() if m["node"] == node and gpu in m["gpus"])
        for tid, actor in enumerate(residents, start=1):
            gpu_tracks[(node, gpu, actor)] = (pid, tid)
            meta_events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": actor}})
    return stage_tracks, gpu_tracks, meta_events


def _stage_order(actors: dict[str, dict]):
    order = {"generate": 0, "reward": 1, "logprob": 2, "train": 3, "controller": 4, "evaluator": 5}
    kinds = {m["stage"]: m["kind"] for m in actors.values()}
    return lambda stage: (order.get(kinds[stage], 9), stage)


def _describe(actor: str, meta: dict) -> str:
    if not meta["gpus"]:
        return f"{actor} (CPU)"
    return f"{actor} (node {meta['node']}, GPU {','.join(map(str, meta['gpus']))})"
