"""The bound on groups generated ahead of the trainer, proved from a journal.

For every version ``v``, the prompt groups generated before ``v`` (by
weights older than ``v``) that were trained at ``v`` or later number at
most ``ahead_groups`` (``max_ahead`` x ``prompts_per_step``, or ``max_lag``
steps when ``max_ahead`` is unset): the rollout side's dispatch rule
(rldsl/runtime/control/sampler.py) guarantees it. A group trained ``lag``
versions after its weights counts at each of the ``lag`` versions between.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainedGroup:
    group: str  # the prompt it was sampled for
    generated: int  # the weight version that generated it (its oldest sample's)
    trained: int  # the trainer version that trained it
    keys: tuple[str, ...]


def crossings(groups: list[TrainedGroup]) -> dict[int, list[TrainedGroup]]:
    """For each version, the groups generated before it and trained at or after it."""
    crossing: dict[int, list[TrainedGroup]] = defaultdict(list)
    for group in groups:
        for version in range(group.generated + 1, group.trained + 1):
            crossing[version].append(group)
    return crossing


def trained_groups(samples: dict) -> list[TrainedGroup]:
    """The trained samples of one segment (key -> replay Sample), gathered
    by prompt (a key without one: by its name up to the sample index)."""
    by_group: dict[str, list[tuple[str, object]]] = defaultdict(list)
    for key, sample in samples.items():
        if sample.trained_version is not None and sample.generated is not None:
            by_group[sample.group or key.rsplit("/", 1)[0]].append((key, sample))
    return [TrainedGroup(group, min(s.generated for _, s in members), max(s.trained_version for _, s in members),
                         tuple(key for key, _ in members))
            for group, members in by_group.items()]
