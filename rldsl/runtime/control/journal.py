"""The per-sample journal: what happened to every sample, one JSON line per
group-level event, so a run can be audited from its journal alone
(`rldsl audit`, rldsl/audit.py).

The control plane records events here as they happen (the ledger its
outcomes, the pumps the versions they know); the buffer is handed to a
writer on ``flush``, which the controller calls after every step and when
the run ends however it ends. The lowering chooses the writer: usually a
``JournalFile`` appending to ``RUN_DIR/journal.jsonl``. The format is
described in docs/runtime.md (Run directory).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from rldsl.runtime.run_files import RunDirectoryError, append_text, repair_torn_tail

JOURNAL_FILE = "journal.jsonl"

# Event kinds, the "e" of every line.
RUN = "run"  # a start or a resume: the header of a segment
DISPATCHED = "dispatched"
GENERATED = "generated"
LOGPROB = "logprob"
TRAINED = "trained"
MASKED = "masked"  # in a step's batch, out of its loss (difficulty_mask)
DROPPED = "dropped"
EPISODES = "episodes"  # each episode's statistics (turns, tool calls), key by key
END = "end"  # how the segment ended

# How a segment ends (the "exit" of an end event).
FINISHED = "finished"  # every step done, the ledger balanced
STOPPED = "stopped"  # a requested stop (Ctrl-C), the ledger balanced
FAILED = "failed"  # an error ended it; samples may be left open
INTERRUPTED = "interrupted"  # cancelled or killed from outside the control plane

Writer = Callable[[list[dict]], None]


class Journal:
    """The events of one segment of a run (a start or a resume), buffered
    until ``flush`` hands them to ``write`` (kept when there is none).

    ``resume`` is where a resumed segment starts (``steps_done``,
    ``version``): steps are numbered from there, as in metrics.jsonl."""

    def __init__(self, write: Writer | None = None, resume: dict | None = None) -> None:
        self._write = write
        self._events: list[dict] = []
        self.resume = resume
        self.step_offset = resume["steps_done"] if resume else 0

    def run_started(self, pipeline: str, max_lag: int, steps: int, ahead_groups: int | None = None) -> None:
        """``ahead_groups``: how many groups generated before a version may
        train at or after it (the sampler's bound, which the audit checks)."""
        bound = {} if ahead_groups is None else {"ahead_groups": ahead_groups}
        self._record(RUN, pipeline=pipeline, max_lag=max_lag, **bound, steps=steps + self.step_offset,
                     resume=self.resume, time=round(time.time(), 3))

    def dispatched(self, keys: Iterable[str], prompt: int | None, replica: int | None) -> None:
        self._record(DISPATCHED, keys, prompt=prompt, replica=replica)

    def generated(self, keys: Iterable[str], version: int, field: str,
                  token_versions: Iterable[Iterable[tuple[int, int]]] = ()) -> None:
        """Generation writes the behaviour logprobs (``field``) with the sample.
        ``token_versions``: when weights changed mid-group (``update =
        interrupt``), each key's ``[version, tokens]`` runs, recorded as
        ``tokens`` once for the keys that share them; ``version`` is the
        group's oldest token's. A sample drawn by one version (one that ended
        before the change, or started after it) has no ``tokens``: the
        group's version overstates its lag, never understates it."""
        keys, token_versions = list(keys), list(token_versions)
        by_runs: dict[tuple, list[str]] = {}
        one_version = keys if not token_versions else []
        for key, runs in zip(keys, token_versions):
            runs = tuple((int(v), int(n)) for v, n in runs)
            if len({v for v, _ in runs}) > 1:
                by_runs.setdefault(runs, []).append(key)
            else:
                one_version.append(key)
        if one_version:
            self._record(GENERATED, one_version, version=version, field=field)
        for runs, same in by_runs.items():
            self._record(GENERATED, same, version=version, field=field, tokens=[list(run) for run in runs])

    def logprob(self, keys: Iterable[str], stage: str, field: str, versions: tuple[int, int] | None,
                batch_start: bool = False) -> None:
        """``versions``: the lowest and highest weight version the stage can
        have computed with (equal when known exactly); None: frozen weights.
        ``batch_start``: scored with the trainer's weights at the start of
        the step that trains them (the audit compares with that version)."""
        if versions is None:
            self._record(LOGPROB, keys, stage=stage, field=field, version=None, frozen=True)
        elif batch_start:
            self._record(LOGPROB, keys, stage=stage, field=field, version=versions[0], batch_start=True)
        elif versions[0] == versions[1]:
            self._record(LOGPROB, keys, stage=stage, field=field, version=versions[0])
        else:
            self._record(LOGPROB, keys, stage=stage, field=field, version=None, between=list(versions))

    def trained(self, keys: Iterable[str], step: int | None, version: int | None, lag: int) -> None:
        """``step`` counts this segment's steps from 1 (as the train pump does)."""
        step = None if step is None else step + self.step_offset
        self._record(TRAINED, keys, step=step, version=version, lag=lag)

    def masked(self, keys: Iterable[str], step: int | None) -> None:
        step = None if step is None else step + self.step_offset
        self._record(MASKED, keys, step=step)

    def episodes(self, keys: Iterable[str], stats: Iterable[dict[str, float]]) -> None:
        """Each sample's episode statistics, as lists in key order (``turns``: [...], ...)."""
        stats = list(stats)
        names = dict.fromkeys(name for sample in stats for name in sample)
        self._record(EPISODES, keys, **{name: [sample.get(name) for sample in stats] for name in names})

    def dropped(self, keys: Iterable[str], reason: str) -> None:
        self._record(DROPPED, keys, reason=reason)

    def ended(self, exit: str, error: BaseException | str | None = None) -> None:
        if isinstance(error, BaseException):
            error = describe_error(error)
        self._record(END, exit=exit, error=error, time=round(time.time(), 3))

    def drain(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def flush(self) -> None:
        """Hand the buffered events to the writer; a writer that raises keeps them."""
        if self._write is not None and self._events:
            self._write(self._events)
            self._events = []

    def _record(self, event: str, keys: Iterable[str] | None = None, **fields) -> None:
        record = {"e": event}
        if keys is not None:
            record["keys"] = list(keys)
            if not record["keys"]:  # a group whose samples were all dropped earlier: nothing happened
                return
        record.update(fields)
        self._events.append(record)


def describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class JournalFile:
    """A writer appending events to a JSON-lines file, one write per flush
    and synced, so a crash loses at most the events not yet flushed.

    Writes are checked (rldsl/runtime/run_files.py): a full or read-only
    run directory raises ``RunDirectoryError`` and leaves the file on whole
    lines (the journal keeps the events for a later flush). A torn last
    line left by a process that died mid-write (or a write the file system
    could not undo) is repaired before the first append, so a resume never
    glues its header onto it; ``repairs`` says what was mended."""

    def __init__(self, path: Path, say: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self.repairs: list[str] = []
        self._say = say if say is not None else _say
        self._tail_checked = False

    def __call__(self, events: list[dict]) -> None:
        if not self._tail_checked:
            self.repair()
        text = "".join(json.dumps(event, separators=(",", ":")) + "\n" for event in events)
        try:
            append_text(self.path, text)
        except RunDirectoryError:
            self._tail_checked = False  # the cut-back may have failed too: look again before the next append
            raise

    def repair(self) -> str | None:
        """Mend a torn last line now (also done before the first append)."""
        repaired = repair_torn_tail(self.path)
        self._tail_checked = True
        if repaired:
            self.repairs.append(repaired)
            self._say(f"note: {repaired}")
        return repaired


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
