"""`rldsl audit RUN_DIR`: prove from a run's journal alone that every sample
was accounted for exactly once, none trained twice (across resumes too),
every trained lag within ``max_lag``, and every logprob field trained on
computed by the weights the staleness rules assume.

replay.py replays the journal and checks; this module finds the journals
of a run directory, prints the result and picks the exit code. Like
`check`, it imports neither torch nor Ray nor an engine.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rldsl.audit.replay import CLEAN_EXITS, PROOFS, JournalError, Replay, latest_run, read_journal
from rldsl.plan import ahead_groups
from rldsl.runtime.control.journal import FINISHED, JOURNAL_FILE

EXIT_OK, EXIT_VIOLATIONS, EXIT_UNREADABLE = 0, 1, 2
SHOWN_KEYS = 5  # keys printed per violation; --format json lists all


@dataclass
class Audit:
    path: Path
    pipeline: str
    replay: Replay
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.replay.violations


def audit_journal(path: Path) -> Audit:
    """Replay one journal; ``JournalError`` when it cannot be read."""
    events, notes = read_journal(path)
    run = latest_run(events)
    if len(run) < len(events):
        notes.append("the journal also holds an earlier run in this directory; only the latest is audited")
    pipeline = run[0].get("pipeline") or path.parent.name
    replay = Replay(*_plan_bounds(path.parent, pipeline)).replay(run)  # the plan's bounds, for headers without them
    return Audit(path, pipeline, replay, notes + replay.notes)


def journal_totals(path: Path) -> dict | None:
    """The whole run's accounting from its journal (every segment, resumes
    included), or None when there is no readable journal."""
    try:
        return audit_journal(path).replay.totals()
    except JournalError:
        return None


def find_journals(run_dir: Path) -> list[Path]:
    """RUN_DIR/journal.jsonl, or RUN_DIR/<pipeline>/journal.jsonl for each
    pipeline of a run of several."""
    if not run_dir.is_dir():
        raise JournalError(f"{run_dir} is not a directory", "pass the run directory `rldsl run` printed at its end")
    if (run_dir / JOURNAL_FILE).exists():
        return [run_dir / JOURNAL_FILE]
    found = [run_dir / name / JOURNAL_FILE for name in _pipelines(run_dir) if (run_dir / name / JOURNAL_FILE).exists()]
    if found:
        return found
    raise JournalError(f"{run_dir} has no {JOURNAL_FILE}",
                       "pass a directory written by `rldsl run` (runs started before the journal existed have none)")


def audit_command(run_dir: Path, fmt: str = "text") -> int:
    try:
        audits = [audit_journal(path) for path in find_journals(Path(run_dir))]
    except JournalError as err:
        print(f"error: {err}", file=sys.stderr)
        print(f"  = help: {err.help}", file=sys.stderr)
        return EXIT_UNREADABLE
    if fmt == "json":
        print(json.dumps({"ok": all(a.ok for a in audits), "pipelines": [to_json(a) for a in audits]}, indent=2))
    else:
        print("\n\n".join(render_text(a) for a in audits))
    return EXIT_OK if all(a.ok for a in audits) else EXIT_VIOLATIONS


def render_text(audit: Audit) -> str:
    notes = [f"note: {note}" for note in audit.notes]
    return "\n".join(_summary_lines(audit) + _open_lines(audit.replay) + notes + _proof_lines(audit))


def _summary_lines(audit: Audit) -> list[str]:
    replay, totals = audit.replay, audit.replay.totals()
    max_lag = replay.segments[0].header.get("max_lag", replay.default_max_lag)
    dropped = ", ".join(f"{reason} {n}" for reason, n in totals["dropped"].items())
    samples = (f"samples: {totals['generated']} dispatched, {totals['trained']} trained, "
               f"{sum(totals['dropped'].values())} dropped" + (f" ({dropped})" if dropped else "")
               + (f", {totals['masked']} masked" if totals.get("masked") else "") + f", {totals['open']} left open")
    if totals["rolled_back"]:
        samples += f", {totals['rolled_back']} rolled back"
    lags = " ".join(f"{lag}:{n}" for lag, n in totals["lag_histogram"].items())
    end = replay.segments[-1].describe_exit()
    token_lags = " ".join(f"{lag}:{n}" for lag, n in totals["token_lag_histogram"].items())
    return [f"journal: {audit.path} (pipeline {audit.pipeline}, {_describe_segments(replay)})", samples,
            f"lag: max {totals['max_lag']} (max_lag {max_lag}); {lags}" if lags
            else f"lag: nothing trained (max_lag {max_lag})",
            *([f"token lag (samples whose weights changed mid-generation, decode steps): {token_lags}"]
              if token_lags else []),
            f"end: {end}" + ("" if totals["exit"] == FINISHED else "; the journal shows the run did not finish")]


def _open_lines(replay: Replay) -> list[str]:
    """Samples left open by segments that did not end cleanly (in the others they are violations)."""
    return [f"note: segment {s.number} ({s.exit or 'cut off'}) left {len(s.open_keys)} samples open: "
            f"{_keys(s.open_keys)}" for s in replay.segments if s.open_keys and s.exit not in CLEAN_EXITS]


def _proof_lines(audit: Audit) -> list[str]:
    lines = ["proofs:"]
    for proof in PROOFS:
        found = [v for v in audit.replay.violations if v.proof == proof]
        lines.append(f"  {'FAIL' if found else 'ok  '} {proof}")
        lines += [f"       segment {v.segment}: {v.what}: {_keys(v.keys)}" for v in found]
    lines.append("audit: every proof holds" if audit.ok else f"audit: {len(audit.replay.violations)} violations")
    return lines


def to_json(audit: Audit) -> dict:
    replay = audit.replay
    return {
        "journal": str(audit.path),
        "pipeline": audit.pipeline,
        "ok": audit.ok,
        "totals": replay.totals(),
        "ahead": {"most": replay.most_ahead,
                  "bound": replay.segments[-1].header.get("ahead_groups", replay.default_ahead_groups)},
        "segments": [{"segment": s.number, "resume": s.header.get("resume"), "exit": s.exit,
                      "error": (s.end or {}).get("error"), "open": s.open_keys} for s in replay.segments],
        "proofs": [{"proof": proof, "ok": not any(v.proof == proof for v in replay.violations),
                    "violations": [{"segment": v.segment, "what": v.what, "keys": v.keys}
                                   for v in replay.violations if v.proof == proof]} for proof in PROOFS],
        "notes": audit.notes,
    }


def _describe_segments(replay: Replay) -> str:
    """Each start or resume and how it ended: `started, stopped; resumed after step 2, finished`."""
    parts = []
    for segment in replay.segments:
        resume = segment.header.get("resume")
        start = f"resumed after step {resume.get('steps_done')}" if resume else "started"
        parts.append(f"{start}, {segment.exit or 'cut off'}")
    return "; ".join(parts)


def _keys(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f" ... ({len(keys)} samples)" if len(keys) > SHOWN_KEYS else "")


def _pipelines(run_dir: Path) -> list[str]:
    """The pipelines run.json names when several share the run directory (none otherwise)."""
    try:
        names = json.loads((run_dir / "run.json").read_text())["pipelines"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [name for name in names if isinstance(name, str)] if len(names) > 1 else []


def _plan_bounds(directory: Path, pipeline: str) -> tuple[int | None, int | None]:
    """max_lag and the groups that may be generated ahead, from the run's plan.json (next to the journal, or
    one up for a run of several pipelines); None for what it does not say."""
    for plan_path in (directory / "plan.json", directory.parent / "plan.json"):
        try:
            plan = json.loads(plan_path.read_text())
            pipe = next(p for p in plan["pipelines"] if p["name"] == pipeline)
            max_lag = pipe["staleness"]["max_lag"]
        except (OSError, ValueError, KeyError, TypeError, StopIteration):
            continue
        try:
            pps = pipe["batch"]["prompts_per_step"]
            return max_lag, ahead_groups(max_lag, pipe["staleness"].get("max_ahead"), pps)
        except (KeyError, TypeError, AttributeError):
            return max_lag, None
    return None, None
