"""Replay a journal (rldsl/runtime/control/journal.py) sample by sample and
check the proofs of `rldsl audit` on the way.

A journal holds segments: a ``run`` header per start or resume, then that
segment's events, then (unless the process died) an ``end``. A header
without a resume point starts a new run in the same file; only the latest
run and its resumes are replayed. Keys name (pipeline, prompt, sample), so a
resumed segment that generates a prompt again uses the same keys.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from rldsl.audit.ahead import crossings, trained_groups
from rldsl.audit.checks import logprob_problem, token_runs_problem
from rldsl.runtime.control import journal as j

# The proofs, in the order they are reported.
ENDED_ONCE = "every dispatched sample ended exactly once (trained, masked or dropped)"
TRAINED_ONCE = "no sample trained twice, across resumes"
LAG = ("every trained sample's lag <= max_lag, and = trainer version - generating version "
       "(with per-token versions: every token's lag <= max_lag, the sample's is its oldest token's)")
LOGPROBS = ("every logprob field trained on was computed as the staleness rules assume "
            "(behaviour_logprobs by the generating version, ref_logprobs by frozen weights)")
AHEAD = ("at most max_ahead x prompts_per_step prompt groups generated before a version trained at or after it "
         "(max_ahead unset: max_lag steps)")
PROOFS = (ENDED_ONCE, TRAINED_ONCE, LAG, AHEAD, LOGPROBS)

CLEAN_EXITS = (j.FINISHED, j.STOPPED)  # the ledger was balanced: nothing may be left open
KEYED_EVENTS = (j.DISPATCHED, j.GENERATED, j.LOGPROB, j.TRAINED, j.MASKED, j.DROPPED, j.EPISODES)


class JournalError(Exception):
    """The journal cannot be read; ``help`` says what to do."""

    def __init__(self, message: str, help: str) -> None:
        super().__init__(message)
        self.help = help


def read_journal(path: Path) -> tuple[list[dict], list[str]]:
    """The events of ``path`` and notes on what was skipped. A writer cut
    off mid-write leaves a torn line: as the last line (skipped), or, when a
    later segment appended without repairing it, glued to the next event on
    the same line (the fragment is skipped, the events after it are kept).
    Any other bad line is a ``JournalError``."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise JournalError(f"no journal at {path}", "pass a run directory written by `rldsl run`") from None
    except (OSError, UnicodeDecodeError) as err:
        raise JournalError(f"cannot read {path}: {err}", "the journal must be a readable JSON-lines file") from None
    lines, notes, events = text.split("\n"), [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(_event(line))
            continue
        except ValueError as err:
            error = err
        if number == len(lines):  # the last line, with no newline after it
            notes.append(f"line {number} is incomplete (the writer was cut off mid-write) and was skipped")
            continue
        mended = _split_glued(line)
        if mended is None:
            raise JournalError(f"{path}:{number}: {error}: {line[:80]}",
                               "the journal is damaged at that line; remove it to audit the rest") from None
        glued, fragment = mended
        events += glued
        notes.append(f"line {number} began with a fragment of a line cut off mid-write, which was skipped; the "
                     f"{len(glued)} event(s) appended after it were read" if fragment else
                     f"line {number} held {len(glued)} events (a newline was cut off mid-write); all were read")
    if not events or events[0]["e"] != j.RUN:
        raise JournalError(f"{path} does not start with a `run` header",
                           "pass a journal written by `rldsl run`" if events else "the journal is empty")
    return events, notes


def _event(text: str) -> dict:
    return _checked_event(json.loads(text))


def _checked_event(event) -> dict:
    if not isinstance(event, dict) or not isinstance(event.get("e"), str):
        raise ValueError("not a journal event")
    if event["e"] in KEYED_EVENTS and not isinstance(event.get("keys"), list):
        raise ValueError(f"a `{event['e']}` event without a list of keys")
    return event


def _split_glued(line: str) -> tuple[list[dict], bool] | None:
    """Whole events run together on one line, after a fragment of a line
    cut off mid-write or not (an append that did not start on a fresh
    line): the events and whether a fragment was skipped, or None when the
    line is not that."""
    decoder = json.JSONDecoder()
    starts = [i for i in range(len(line)) if line.startswith(_EVENT_START, i)]
    for start in starts:  # the earliest start from which the rest of the line is whole events
        events, position = [], start
        try:
            while position < len(line):
                event, position = decoder.raw_decode(line, position)
                events.append(_checked_event(event))
        except ValueError:
            continue
        return events, start > 0
    return None


_EVENT_START = '{"e":'


def latest_run(events: list[dict]) -> list[dict]:
    """The events from the last fresh start on (a header without a resume point)."""
    starts = [i for i, e in enumerate(events) if e["e"] == j.RUN and not e.get("resume")]
    return events[starts[-1]:] if starts else events


@dataclass
class Violation:
    proof: str
    what: str
    keys: list[str]
    segment: int


@dataclass
class Sample:
    """One key within one segment."""

    generated: int | None = None  # the weight version that generated it (its oldest token's)
    tokens: list | None = None  # [version, steps] runs over its group's decode steps, when weights changed mid-group
    writes: dict[str, dict] = field(default_factory=dict)  # logprob field -> the event that wrote it last
    outcome: str | None = None  # "trained", "masked" or the drop reason
    group: str | None = None  # the prompt it was sampled for
    trained_version: int | None = None


@dataclass
class Segment:
    number: int  # 1 for the start, 2 for the first resume, ...
    header: dict
    end: dict | None = None
    samples: dict[str, Sample] = field(default_factory=dict)
    open_keys: list[str] = field(default_factory=list)

    @property
    def exit(self) -> str | None:
        return self.end.get("exit") if self.end else None

    def describe_exit(self) -> str:
        if self.end is None:
            return "no end record (the process writing the journal died)"
        error = self.end.get("error")
        return f"{self.exit}: {error}" if error else str(self.exit)


class Replay:
    """Feed it a run's events in order (``replay``); it keeps the totals and
    every violation of the proofs. ``max_lag``, ``ahead_groups``: the bounds when a header has none."""

    def __init__(self, max_lag: int | None = None, ahead_groups: int | None = None) -> None:
        self.default_max_lag = max_lag
        self.default_ahead_groups = ahead_groups
        self.segments: list[Segment] = []
        self.violations: list[Violation] = []
        self.notes: list[str] = []
        self.trained_at: dict[str, tuple[int, int | None, int]] = {}  # key -> (segment, step, lag)
        self.dispatched = 0
        self.rolled_back = 0
        self.dropped: Counter[str] = Counter()
        self.masked = 0  # in a step, out of its loss (difficulty_mask)
        self.token_lags: Counter[int] = Counter()  # decode steps of trained samples by lag (per-token versions)
        self.most_ahead = 0  # the most groups generated before a version that trained at or after it

    def replay(self, events: list[dict]) -> "Replay":
        if events and events[0]["e"] != j.RUN:
            raise JournalError("the events do not start with a `run` header", "pass a journal written by `rldsl run`")
        for event in events:
            handler = getattr(self, f"_on_{event['e']}", None)
            if handler is None:
                self.notes.append(f"unknown event `{event['e']}` ignored")
            elif event["e"] == j.RUN or self.segments[-1].end is None:
                handler(event)
            else:
                self.notes.append(f"a `{event['e']}` event after the end of segment {self.segments[-1].number} "
                                  "was ignored")
        self._close_segment()
        return self

    # ------------------------------------------------------------- events

    def _on_run(self, event: dict) -> None:
        self._close_segment()
        resume = event.get("resume")
        if resume and resume.get("steps_done") is not None:
            self._roll_back(resume["steps_done"])
        self.segments.append(Segment(len(self.segments) + 1, event))

    def _on_dispatched(self, event: dict) -> None:
        segment, keys = self.segments[-1], event["keys"]
        self.dispatched += len(keys)
        twice = [k for k in keys if k in segment.samples]
        self._violate(ENDED_ONCE, "dispatched twice in one segment", twice)
        retried = [k for k in keys if k in self.trained_at and self.trained_at[k][0] < segment.number]
        self._violate(TRAINED_ONCE, "generated again after a resume although already trained "
                                    f"(segment {self._first(retried)})", retried)
        group = None if event.get("prompt") is None else str(event["prompt"])
        for key in keys:
            segment.samples.setdefault(key, Sample(group=group))

    def _on_generated(self, event: dict) -> None:
        for key, sample in self._known(event).items():
            sample.generated = event.get("version")
            sample.tokens = event.get("tokens")
            if event.get("field"):
                sample.writes[event["field"]] = {"stage": "generation", "version": event.get("version")}

    def _on_logprob(self, event: dict) -> None:
        for sample in self._known(event).values():
            sample.writes[event["field"]] = event

    def _on_trained(self, event: dict) -> None:
        segment = self.segments[-1]
        earlier = defaultdict(list)
        for key in event["keys"]:
            if key in self.trained_at:
                earlier[self.trained_at[key][:2]].append(key)
        for (seg, step), keys in earlier.items():
            self._violate(TRAINED_ONCE, f"trained twice: segment {seg} step {step}, then segment "
                                        f"{segment.number} step {event.get('step')}", keys)
        samples = self._ended(event, j.TRAINED)
        self._check_lag(event, samples)
        self._check_logprobs(samples, event.get("version"))
        for key, sample in samples.items():
            self.trained_at[key] = (segment.number, event.get("step"), event.get("lag"))
            sample.trained_version = event.get("version")

    def _on_masked(self, event: dict) -> None:
        self.masked += len(self._ended(event, j.MASKED))

    def _on_dropped(self, event: dict) -> None:
        samples = self._ended(event, event.get("reason") or "unknown")
        self.dropped[event.get("reason") or "unknown"] += len(samples)

    def _on_episodes(self, event: dict) -> None:
        """Statistics only (turns, tool calls): no sample's outcome changes."""

    def _on_end(self, event: dict) -> None:
        self.segments[-1].end = event

    # ------------------------------------------------------------- checks

    def _ended(self, event: dict, outcome: str) -> dict[str, Sample]:
        """The event's samples that end now; a second outcome is a violation."""
        fresh, by_previous = {}, defaultdict(list)
        for key, sample in self._known(event).items():
            if sample.outcome is None:
                sample.outcome = outcome
                fresh[key] = sample
            else:
                by_previous[sample.outcome].append(key)
        for previous, keys in by_previous.items():
            self._violate(ENDED_ONCE, f"{outcome} after already {previous}", keys)
        return fresh

    def _check_lag(self, event: dict, samples: dict[str, Sample]) -> None:
        max_lag = self.segments[-1].header.get("max_lag", self.default_max_lag)
        lag, version = event.get("lag"), event.get("version")
        if max_lag is None:
            self._violate(LAG, "max_lag unknown (no header field, no plan.json): the bound cannot be proved",
                          list(samples))
        elif lag is None:
            self._violate(LAG, f"no lag recorded (step {event.get('step')})", list(samples))
        elif lag > max_lag:
            self._violate(LAG, f"lag {lag} > max_lag {max_lag} (step {event.get('step')})", list(samples))
        by_generation = defaultdict(list)
        for key, sample in samples.items():
            if sample.generated is None or version is None or version - sample.generated != lag:
                by_generation[sample.generated].append(key)
        for generated, keys in by_generation.items():
            if generated is None:
                self._violate(LAG, "trained, but no `generated` event says which version generated it", keys)
            else:
                self._violate(LAG, f"lag {lag} recorded, but generated at version {generated} and trained at "
                                   f"version {version}", keys)
        self._check_token_lags(event, samples, max_lag)

    def _check_token_lags(self, event: dict, samples: dict[str, Sample], max_lag: int | None) -> None:
        """Samples with per-token versions: each token's lag within the bound,
        and the recorded version their oldest token's (the lag the trainer used)."""
        version, found = event.get("version"), defaultdict(list)
        for key, sample in samples.items():
            if sample.tokens is None:
                continue
            problem = token_runs_problem(sample.tokens, sample.generated)
            if problem is None and version is not None:
                lags = Counter({version - v: n for v, n in sample.tokens})
                self.token_lags.update(lags)
                worst = max(lags)
                if max_lag is not None and worst > max_lag:
                    problem = (f"{lags[worst]} token(s) at lag {worst} > max_lag {max_lag} "
                               f"(step {event.get('step')})")
            if problem:
                found[problem].append(key)
        for problem, keys in found.items():
            self._violate(LAG, problem, keys)

    def _check_logprobs(self, samples: dict[str, Sample], trained_at: int | None = None) -> None:
        found = defaultdict(list)
        for key, sample in samples.items():
            for name, write in sample.writes.items():
                problem = logprob_problem(name, write, sample.generated, trained_at)
                if problem:
                    found[problem].append(key)
        for problem, keys in found.items():
            self._violate(LOGPROBS, problem, keys)

    # ------------------------------------------------------------- helpers

    def _known(self, event: dict) -> dict[str, Sample]:
        """The event's samples dispatched in this segment; the others are a violation."""
        samples = self.segments[-1].samples
        unknown = [k for k in event.get("keys", []) if k not in samples]
        self._violate(ENDED_ONCE, f"{event['e']} but never dispatched in this segment", unknown)
        return {k: samples[k] for k in event.get("keys", []) if k in samples}

    def _close_segment(self) -> None:
        if not self.segments:
            return
        segment = self.segments[-1]
        segment.open_keys = [k for k, s in segment.samples.items() if s.outcome is None]
        if segment.open_keys and segment.exit in CLEAN_EXITS:
            self._violate(ENDED_ONCE, f"left open although the segment ended `{segment.exit}`", segment.open_keys)
        self._check_ahead(segment)

    def _check_ahead(self, segment: Segment) -> None:
        bound = segment.header.get("ahead_groups", self.default_ahead_groups)
        crossing = crossings(trained_groups(segment.samples))
        self.most_ahead = max([self.most_ahead, *map(len, crossing.values())])
        if bound is None:
            if crossing:
                self.notes.append(f"segment {segment.number}: the bound on groups generated ahead is unknown (no "
                                  "header field, no plan.json): it was not checked")
            return
        for version in sorted(v for v, groups in crossing.items() if len(groups) > bound):
            self._violate(AHEAD, f"{len(crossing[version])} groups generated before version {version} trained at "
                                 f"or after it > {bound}", [key for group in crossing[version] for key in group.keys])

    def _roll_back(self, steps_done: int) -> None:
        """Resuming from the checkpoint after step ``steps_done`` discards what later steps trained."""
        later = [k for k, (_, step, _) in self.trained_at.items() if step is not None and step > steps_done]
        for key in later:
            del self.trained_at[key]
        self.rolled_back += len(later)
        if later:
            self.notes.append(f"{len(later)} samples trained after step {steps_done} were rolled back by the "
                              "resume from that step's checkpoint (they may be trained again)")

    def _first(self, keys: list[str]) -> int | None:
        return self.trained_at[keys[0]][0] if keys else None

    def _violate(self, proof: str, what: str, keys: list[str]) -> None:
        if keys:
            self.violations.append(Violation(proof, what, list(keys), self.segments[-1].number))

    # ------------------------------------------------------------- results

    def totals(self) -> dict:
        """The whole run, every segment: what summary.json calls its ledger."""
        lags = Counter(lag for _, _, lag in self.trained_at.values() if lag is not None)
        last = self.segments[-1] if self.segments else None
        return {
            "generated": self.dispatched,
            "trained": len(self.trained_at),
            "dropped": dict(sorted(self.dropped.items())),
            **({"masked": self.masked} if self.masked else {}),
            "open": sum(len(s.open_keys) for s in self.segments),
            "rolled_back": self.rolled_back,
            "max_lag": max(lags) if lags else None,
            "lag_histogram": dict(sorted(lags.items())),
            "token_lag_histogram": dict(sorted(self.token_lags.items())),
            "steps": max((step for _, step, _ in self.trained_at.values() if step is not None), default=0),
            "resumes": max(len(self.segments) - 1, 0),
            "exit": last.exit if last else None,
        }
