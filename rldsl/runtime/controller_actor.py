"""The single controller as a CPU-only Ray actor.

It owns the asyncio pumps (rldsl.runtime.controller) and answers progress
queries from the driver while they run (an async actor serves both).
"""

from __future__ import annotations

import time
from typing import Iterator

from rldsl.plan import PipelinePlan
from rldsl.runtime.protocols import Prompt
from rldsl.runtime.settings import RunSettings


def prompt_stream(pipe: PipelinePlan, seed: int, start_index: int = 0) -> Iterator[Prompt]:
    """The training prompts, epoch after epoch (reshuffled when the dataset
    says so), each with a unique, increasing index."""
    import random

    from rldsl.tasks import load_dataset

    dataset = pipe.datasets[0]
    options = {k: v for k, v in dataset.options.items() if k in ("prompt_field", "answer_field")}
    if dataset.source.startswith("builtin:"):
        options = {"seed": seed}
    rows = load_dataset(dataset.source, "train", **options)
    index, epoch = 0, 0
    while True:
        order = list(range(len(rows)))
        if dataset.options.get("shuffle", True):
            random.Random(seed + epoch).shuffle(order)
        for i in order:
            if index >= start_index:
                yield Prompt(index, rows[i].text, rows[i].answer, dict(rows[i].meta))
            index += 1
        epoch += 1


class ControllerActor:
    def __init__(self, settings: RunSettings, pipe: PipelinePlan, workers: dict, receivers: list,
                 dataplane_spec: dict, start_index: int = 0):
        from rldsl.runtime.dataplane import connect_dataplane
        from rldsl.runtime.ray_handles import ray_stage_handles

        self.settings, self.pipe = settings, pipe
        kinds = {s.name: s.kind for s in pipe.stages}
        self.handles = ray_stage_handles(workers, kinds, receivers, settings.sync_bucket_bytes,
                                         pipe.batch.train_stage)
        self.dataplane = connect_dataplane(dataplane_spec)
        self.start_index = start_index
        self.steps: list[dict] = []
        self.controller = None

    async def run(self) -> dict:
        from rldsl.runtime.controller import Controller

        self.controller = Controller(self.settings, self.handles, self.dataplane,
                                     prompt_stream(self.pipe, self.settings.seed, self.start_index),
                                     on_step=self._on_step)
        return await self.controller.run()

    def _on_step(self, record: dict) -> None:
        self.steps.append({**record, "time": time.time()})

    async def progress(self, since: int) -> dict:
        """Step records after ``since``, and what each pump is doing now."""
        waits = self.controller.describe_waits() if self.controller else "starting"
        return {"steps": self.steps[since:], "waits": waits}
