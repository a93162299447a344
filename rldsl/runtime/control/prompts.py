"""The training prompts of a pipeline, as the rollout pump consumes them."""

from __future__ import annotations

import random
from typing import Iterator

from rldsl.plan import PipelinePlan
from rldsl.runtime.protocols import Prompt


def dataset_options(pipe: PipelinePlan, seed: int) -> dict:
    """The `load_dataset` options of the pipeline's dataset: builtin tasks
    take the run's seed, jsonl files their field names."""
    dataset = pipe.datasets[0]
    if dataset.source.startswith("builtin:"):
        return {"seed": seed}
    return {k: v for k, v in dataset.options.items() if k in ("prompt_field", "answer_field")}


def prompt_stream(pipe: PipelinePlan, seed: int, trained_below: int = 0,
                  trained_above: frozenset[int] = frozenset()) -> Iterator[Prompt]:
    """The training prompts, epoch after epoch (reshuffled when the dataset
    says so), each with a unique, increasing index. Indices already trained
    (below ``trained_below`` or in ``trained_above``) are skipped: a resumed
    run never trains a prompt twice."""
    from rldsl.tasks import load_dataset

    dataset = pipe.datasets[0]
    rows = load_dataset(dataset.source, "train", **dataset_options(pipe, seed))
    index, epoch = 0, 0
    while True:
        order = list(range(len(rows)))
        if dataset.options.get("shuffle", True):
            random.Random(seed + epoch).shuffle(order)
        for i in order:
            if index >= trained_below and index not in trained_above:
                yield Prompt(index, rows[i].text, rows[i].answer, dict(rows[i].meta))
            index += 1
        epoch += 1
