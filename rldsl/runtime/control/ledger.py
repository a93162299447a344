"""Every sample ends exactly once: trained, masked, or dropped with a reason.

Masked samples were in a step's batch but out of its loss (a difficulty
mask's groups): not trained, not dropped either, since no prompt replaced
them.

The controller registers a group's sample keys when it dispatches the group
and records one outcome per key. Violations (an outcome for an unknown key,
a second outcome) are collected rather than raised on the spot, so one
``check()`` reports all of them together with the samples left open. Every
call is also recorded in the run's journal (journal.py), violations included:
the journal is the evidence `rldsl audit` checks.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from rldsl.runtime.control.journal import Journal

TRAINED = "trained"
MASKED = "masked"  # in its step with no weight in the loss (difficulty_mask)

# Drop reasons the runtime uses; engines and layers may add their own.
TOO_STALE = "too_stale"
REWARD_FAILED = "reward_failed"  # the reward call failed as a whole, or gave no reason
REWARD_RAISED = "reward_raised"  # the function raised for this sample
REWARD_TIMEOUT = "reward_timeout"  # it overran the stage's timeout and was killed
REWARD_STRAGGLER = "reward_straggler"  # it ran the stage's `straggler` times the usual time and was killed
REWARD_INVALID = "reward_invalid"  # it returned something that is not a finite number
LOGPROB_FAILED = "logprob_failed"
GENERATION_FAILED = "generation_failed"
STEP_ABORTED = "step_aborted"
WORKER_DIED = "worker_died"  # its actor died and the work could not be redone
ZERO_VARIANCE = "zero_variance"  # dynamic sampling: every sample of its group had the same reward
STALE_LOGPROBS = "stale_logprobs"  # its behaviour logprobs came from other weights than generated it
STEP_SKIPPED = "step_skipped"  # its step took no optimizer step (no tokens, an fp16 overflow)
RUN_FINISHED = "run_finished"  # generated after the last step needed it
RUN_STOPPED = "run_stopped"  # in the open step when the run was stopped (Ctrl-C)


# What each drop means, as the end of a run says it (docs/runtime.md#accounting has them all).
DROP_MEANINGS = {
    TOO_STALE: "generated with weights older than max_lag allows",
    REWARD_FAILED: "the reward call failed as a whole (its worker lost, or the function no longer imports)",
    REWARD_RAISED: "the reward function raised, or its process died",
    REWARD_TIMEOUT: "the reward overran the stage's `timeout` and its process was killed",
    REWARD_STRAGGLER: "the reward ran the stage's `straggler` times its usual time per sample and was taken for "
                      "hung",
    REWARD_INVALID: "the reward returned something that is not a finite number (for a judge: text it could not "
                    "parse)",
    LOGPROB_FAILED: "a logprob call failed",
    GENERATION_FAILED: "a generation call failed",
    STEP_ABORTED: "a failed call aborted its step",
    WORKER_DIED: "its actor died and no replacement could redo the work",
    ZERO_VARIANCE: "every sample of its group had the same reward (dynamic sampling)",
    STALE_LOGPROBS: "its logprobs came from other weights than the ones that generated it",
    STEP_SKIPPED: "its step took no optimizer step (no tokens, or an fp16 overflow)",
    RUN_FINISHED: "generated after the last step needed it",
    RUN_STOPPED: "in the open step when the run was stopped",
    "environment_raised": "the environment's reset or step raised, or returned something malformed",
    "environment_timeout": "an environment call overran its timeout",
    "environment_died": "the process running an environment call died",
    "environment_straggler": "an environment call ran `straggler` times its usual time and was taken for hung",
    "environment_tokenization": "the conversation did not extend the tokens generated so far (an agent harness "
                                "that rewrote earlier turns; runs before turns were kept as tokens: text that "
                                "re-tokenized differently)",
}


def drop_meaning(reason: str) -> str:
    return DROP_MEANINGS.get(reason, "see docs/runtime.md#accounting")


class LedgerError(AssertionError):
    """Some sample was not accounted for exactly once."""


class Ledger:
    def __init__(self, journal: Journal | None = None) -> None:
        self.journal = journal if journal is not None else Journal()
        self._outcome: dict[str, str | None] = {}  # key -> None while open
        self._lag_histogram: Counter[int] = Counter()
        self._dropped: Counter[str] = Counter()
        self._masked = 0
        self._violations: list[str] = []
        self._open = 0
        self._trained_in_order: list[str] = []  # read incrementally by progress checkpoints

    def register(self, keys: Iterable[str], prompt: int | None = None, replica: int | None = None) -> None:
        keys = list(keys)
        self.journal.dispatched(keys, prompt, replica)
        for key in keys:
            if key in self._outcome:
                self._violations.append(f"{key}: generated twice")
            else:
                self._outcome[key] = None
                self._open += 1

    def trained(self, keys: Iterable[str], lag: int, step: int | None = None, version: int | None = None) -> None:
        """``step``: the step (from 1) that trained them, ``version``: the trainer's version it trained at."""
        keys = list(keys)
        self.journal.trained(keys, step, version, lag)
        for key in keys:
            if self._close(key, TRAINED):
                self._lag_histogram[lag] += 1
                self._trained_in_order.append(key)

    def masked(self, keys: Iterable[str], step: int | None = None) -> None:
        """Kept in ``step`` (from 1) but masked out of its loss."""
        keys = list(keys)
        self.journal.masked(keys, step)
        self._masked += sum(self._close(key, MASKED) for key in keys)

    def dropped(self, keys: Iterable[str], reason: str) -> None:
        if not reason or reason in (TRAINED, MASKED):
            raise ValueError(f"invalid drop reason {reason!r}")
        keys = list(keys)
        self.journal.dropped(keys, reason)
        for key in keys:
            if self._close(key, reason):
                self._dropped[reason] += 1

    def trained_keys(self, start: int = 0) -> list[str]:
        """Keys trained so far, in training order, from position ``start``
        (callers that keep a cursor pay only for what is new)."""
        return self._trained_in_order[start:]

    def open_keys(self) -> list[str]:
        return [key for key, outcome in self._outcome.items() if outcome is None]

    def check(self) -> None:
        """Raise ``LedgerError`` unless every sample ended exactly once."""
        problems = list(self._violations)
        open_keys = self.open_keys()
        if open_keys:
            shown = ", ".join(open_keys[:5]) + (" ..." if len(open_keys) > 5 else "")
            problems.append(f"{len(open_keys)} samples neither trained nor dropped: {shown}")
        if problems:
            raise LedgerError("ledger does not balance:\n  " + "\n  ".join(problems))

    @property
    def generated(self) -> int:
        return len(self._outcome)

    @property
    def trained_count(self) -> int:
        return sum(self._lag_histogram.values())

    @property
    def max_lag(self) -> int | None:
        return max(self._lag_histogram) if self._lag_histogram else None

    @property
    def lag_histogram(self) -> dict[int, int]:
        return dict(sorted(self._lag_histogram.items()))

    def summary(self) -> dict:
        return {
            "generated": self.generated,
            "trained": self.trained_count,
            "dropped": dict(sorted(self._dropped.items())),
            **({"masked": self._masked} if self._masked else {}),
            "open": self._open,
            "max_lag": self.max_lag,
            "lag_histogram": self.lag_histogram,
        }

    def _close(self, key: str, outcome: str) -> bool:
        if key not in self._outcome:
            self._violations.append(f"{key}: {outcome} but never generated")
            return False
        previous = self._outcome[key]
        if previous is not None:
            self._violations.append(f"{key}: {outcome} after already {previous}")
            return False
        self._outcome[key] = outcome
        self._open -= 1
        return True
