"""Per-sample checks of the journal replay (replay.py): well-formed
per-token versions, and logprob fields computed by the weights the
staleness rules assume."""

from __future__ import annotations

from rldsl.runtime.protocols import FIELD_BEHAVIOUR_LOGPROBS, FIELD_REF_LOGPROBS


def token_runs_problem(runs, generated: int | None) -> str | None:
    """Why a ``tokens`` list is not well formed, or None: ``[version, steps]``
    pairs with steps >= 1, none older than the version recorded as generating
    (the group's oldest token's: a sample of the group may start later, a
    token older than the record would understate its lag)."""
    if not isinstance(runs, list) or not runs or not all(
            isinstance(run, list) and len(run) == 2 and all(isinstance(x, int) for x in run) and run[1] >= 1
            for run in runs):
        return f"per-token versions {str(runs)[:60]} are not [version, steps] runs"
    oldest = min(version for version, _ in runs)
    if generated is None or oldest < generated:
        return f"generated at version {generated}, but its oldest token is version {oldest}"
    return None


def logprob_problem(name: str, write: dict, generated: int | None, trained_at: int | None = None) -> str | None:
    """Why a logprob field is not what the staleness rules assume, or None.
    behaviour_logprobs must come from the generating weights exactly (the
    importance ratio and the lag assume it), or, written with ``batch_start``
    (``recompute = batch_start``), from the trainer's version ``trained_at``
    of the step that trained it; ref_logprobs from frozen weights. Other
    fields carry no rule."""
    stage = write.get("stage")
    if name == FIELD_REF_LOGPROBS and not write.get("frozen"):
        return f"{name} by stage `{stage}` whose weights are not frozen (version {write.get('version')})"
    if name != FIELD_BEHAVIOUR_LOGPROBS:
        return None
    if write.get("frozen"):
        return f"{name} by stage `{stage}` with frozen weights, not the generating version {generated}"
    if write.get("version") is None:
        between = write.get("between")
        known = f"between versions {between[0]} and {between[1]}" if between else "at an unknown version"
        return f"{name} by stage `{stage}` {known}: not provably the generating version {generated}"
    if write.get("batch_start"):
        if write["version"] != trained_at:
            return f"{name} by stage `{stage}` at version {write['version']}, trained at version {trained_at}"
        return None
    if write["version"] != generated:
        return f"{name} by stage `{stage}` at version {write['version']}, generated at version {generated}"
    return None
