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
from rldsl.runtime.control.journal import FAILED, JOURNAL_FILE, STOPPED
from rldsl.runtime.run_files import RunDirectoryError, write_json_checked

SUMMARY_FILE = "summary.json"
_RUN_LEDGER = ("generated", "trained", "dropped", "open", "rolled_back", "max_lag", "lag_histogram")


def write_summary(run_dir: Path, segment: dict | None, pipeline: str, error: str | None = None,
                  stop: dict | None = None) -> dict:
    """``segment``: the controller's summary of this segment, None when the
    controller could not answer (its actor died); ``error``: what ended the
    run on the driver's side, if anything did; ``stop``: the signal that
    stopped it and the command that resumes it. Returns what was written."""
    summary = {"pipeline": pipeline, **(segment or {}), **(stop or {})}
    if stop and error is None and summary.get("exit") is None:  # the controller had not reached its safe point
        summary.update(exit=STOPPED, error=f"stopped by {stop['signal']} before the controller reached a safe point")
    if error is not None and summary.get("exit") != FAILED:
        summary.update(exit=FAILED, error=error)
    elif summary.get("exit") is None:  # the controller never said how it ended
        summary.update(exit=FAILED, error=error or "the controller ended without a summary (its actor died?)")
    summary["segment_ledger"] = summary.pop("ledger", None)
    totals = journal_totals(Path(run_dir) / JOURNAL_FILE)
    if totals is not None:
        summary["ledger"] = {key: totals[key] for key in (*_RUN_LEDGER, "masked") if key in totals}
        summary["max_lag"] = totals["max_lag"]
        summary["resumes"] = totals["resumes"]
        summary.setdefault("steps", totals["steps"])
    else:  # no readable journal: this segment is all there is to say
        summary["ledger"] = summary["segment_ledger"]
    try:
        write_json_checked(Path(run_dir) / SUMMARY_FILE, summary, indent=2)
    except RunDirectoryError as error:  # said by the caller; never a second error over the run's own
        summary["not_written"] = str(error)
    return summary
