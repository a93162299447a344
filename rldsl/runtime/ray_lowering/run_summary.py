"""summary.json, written on every exit path of a run (finished, stopped by
Ctrl-C, failed), and cumulative over its resumes.

The controller's summary covers the segment this process ran (a start or
a resume) and says how it ended. The whole run's accounting, every segment
included, is read back from the journal, the one record that spans them
(`rldsl audit` replays it the same way).
"""

from __future__ import annotations

from pathlib import Path

from rldsl.audit import journal_totals
from rldsl.runtime.atomic import write_json_atomically
from rldsl.runtime.control.journal import FAILED, JOURNAL_FILE

SUMMARY_FILE = "summary.json"
_RUN_LEDGER = ("generated", "trained", "dropped", "open", "rolled_back", "max_lag", "lag_histogram")


def write_summary(run_dir: Path, segment: dict | None, pipeline: str, error: str | None = None) -> dict:
    """``segment``: the controller's summary of this segment, None when the
    controller could not answer (its actor died); ``error``: what ended the
    run on the driver's side, if anything did. Returns what was written."""
    summary = {"pipeline": pipeline, **(segment or {})}
    if error is not None and summary.get("exit") != FAILED:
        summary.update(exit=FAILED, error=error)
    elif summary.get("exit") is None:  # the controller never said how it ended
        summary.update(exit=FAILED, error=error or "the controller ended without a summary (its actor died?)")
    summary["segment_ledger"] = summary.pop("ledger", None)
    totals = journal_totals(Path(run_dir) / JOURNAL_FILE)
    if totals is not None:
        summary["ledger"] = {key: totals[key] for key in _RUN_LEDGER}
        summary["max_lag"] = totals["max_lag"]
        summary["resumes"] = totals["resumes"]
        summary.setdefault("steps", totals["steps"])
    else:  # no readable journal: this segment is all there is to say
        summary["ledger"] = summary["segment_ledger"]
    write_json_atomically(Path(run_dir) / SUMMARY_FILE, summary, indent=2)
    return summary
