"""Stage handles that return at once: what is left of a run is the controller."""

from __future__ import annotations

from rldsl.runtime.control.handles import StageHandles
from rldsl.runtime.protocols import Generated, StepResult


def null_handles(train_replicas: int = 1, generator_replicas: int = 1, tokens: int = 8) -> StageHandles:
    versions = {"trainer": 0}

    async def generate(replica, prompts, keys, samples_per_prompt, seed):
        return Generated(versions["trainer"], tokens * len(keys))

    async def reward(stage, keys):
        return [float(i % 2) for i in range(len(keys))]

    async def nothing(*args):
        return {}

    async def finish(step):
        versions["trainer"] += 1
        return StepResult(versions["trainer"], {})

    async def generator_version():
        return 0

    return StageHandles(generate, reward, nothing, nothing, nothing, finish, nothing, nothing, nothing,
                        generator_version, generator_replicas=generator_replicas, train_replicas=train_replicas)


class NullDataPlane:
    def put(self, keys, partition, fields, tags=None):
        pass

    def clear(self, keys, partition):
        pass
