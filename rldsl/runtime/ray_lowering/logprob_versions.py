"""A policy logprob rank that scores every row with the weights that generated it.

Generators swap weights only between batches, so rows of version v keep
arriving after version v + 1 was pushed. A logprob stage that applied each
push at once would score them with v + 1, and the trainer's fence would
drop them (``stale_logprobs``). Instead a policy logprob rank keeps the
pushes it may still need (their object-store references: the host bucket
cache's own copies, no extra memory while they are cached) and, per call,
loads the version each row was generated with: ``max_lag + 1`` versions
back from the newest, since an older row is too stale to train anyway.
The weights it started with are kept as a host copy the first time it
moves off them, when the engine can give one (``weight_snapshot``).

Rows of one version are scored together, the loaded version first, so a
call whose rows share a version costs no swap and a fleet moving forward
costs one load per version.

With ``recompute = batch_start`` every row is scored with one version the
caller names instead: the trainer's at the start of the step that trains
the row (verl's and ROLL's old-log-prob recompute). Only the newest push
is then ever asked for, so the stage keeps just that one (window 0).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from rldsl.runtime.protocols import FIELD_RESPONSE_IDS


class VersionedScorer:
    """``engine``: a logprob engine (``logprobs``, ``update_weights``,
    ``version``); ``window``: how many versions back from the newest to keep
    (``max_lag``); ``fetch``: turns kept references into buckets
    (``ray.get``)."""

    def __init__(self, engine, window: int, fetch: Callable[[list], list]):
        self.engine = engine
        self.window = window
        self.fetch = fetch
        self.kept: dict[int, tuple[list, bool]] = {}  # version -> (buckets or references, fetched already)
        self.newest = int(getattr(engine, "version", 0))
        self.loads = 0  # versions loaded to score a call's rows (the cost of keeping them)

    def receive(self, bucket_refs: list, version: int) -> None:
        """A push: kept, applied only when a row needs it."""
        self.kept[version] = (list(bucket_refs), False)
        self.newest = max(self.newest, version)
        for old in [v for v in self.kept if v < self.newest - self.window]:
            del self.kept[old]

    def score_at(self, batch: dict, generated_at: Sequence[int],
                 version: int | None = None) -> tuple[torch.Tensor, list[int]]:
        """Every row under ``version`` (``recompute = batch_start``), or
        under the version that generated it when None."""
        return self.score(batch, list(generated_at) if version is None else [version] * len(generated_at))

    def score(self, batch: dict, versions: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """Log-probabilities of every row, each under its own generating
        version when kept (else the newest: the trainer's fence then drops
        the row, and counts it); returns them with the version used per row."""
        rows_by_version: dict[int, list[int]] = {}
        for row, version in enumerate(versions):
            rows_by_version.setdefault(self._available(int(version)), []).append(row)
        current = self._loaded()
        order = sorted(rows_by_version, key=lambda v: (v != current, v))
        result: torch.Tensor | None = None
        used = [0] * len(versions)
        for version in order:
            rows = rows_by_version[version]
            self._load(version)
            values = self.engine.logprobs(_take(batch, rows))
            if result is None:
                result = values.new_zeros((len(versions), batch[FIELD_RESPONSE_IDS].shape[1]))
            result[rows, :values.shape[1]] = values
            for row in rows:
                used[row] = version
        return (result if result is not None else torch.zeros(0, 0)), used

    def _available(self, version: int) -> int:
        if version in self.kept or version == self._loaded():
            return version
        return max(self.kept, default=self._loaded())

    def _loaded(self) -> int:
        return int(getattr(self.engine, "version", 0))  # an engine that never received weights has version 0

    def _load(self, version: int) -> None:
        current = self._loaded()
        if version == current:
            return
        if current not in self.kept and current >= self.newest - self.window:
            self._keep_loaded(current)
        buckets, fetched = self.kept[version]
        buckets = buckets if fetched else self.fetch(buckets)
        for index, bucket in enumerate(buckets):
            self.engine.update_weights(bucket, version, index == len(buckets) - 1)
        self.loads += 1

    def _keep_loaded(self, version: int) -> None:
        """The weights loaded now, which no push brought (the initial ones):
        a host copy, when the engine can make one."""
        snapshot = getattr(self.engine, "weight_snapshot", None)
        if snapshot is not None:
            self.kept[version] = (snapshot(), True)


def _take(batch: dict, rows: list[int]) -> dict[str, Any]:
    """Those rows of every field (all of them: no copy)."""
    if rows == list(range(len(next(iter(batch.values()))))):
        return batch
    index = torch.tensor(rows, dtype=torch.long)
    return {name: value.index_select(0, index) if isinstance(value, torch.Tensor) else value
            for name, value in batch.items()}
