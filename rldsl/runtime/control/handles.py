"""The interface between the control plane and a lowering: ``StageHandles``.

The controller drives stages only through these async callables; the Ray
lowering implements them over actors (``ray_lowering.stage_handles``), the
in-process lowering over sim engines (``inprocess.sim_stages``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Sequence

from rldsl.runtime.protocols import Prompt, StepResult


async def _nothing() -> None:
    return None


@dataclass(frozen=True)
class StageHandles:
    """The async callables the controller drives; the Ray layer implements
    them over actors, ``inprocess.sim_stage_handles`` in process.

    Only keys and metadata cross this boundary: engines read and write the
    sample fields in the data plane themselves.

    - ``generate(prompts, keys, samples_per_prompt, seed) -> version``:
      generate ``samples_per_prompt`` responses per prompt, write them under
      ``keys`` (prompt-major), and return the weight version used. The
      controller calls it once per prompt group and never while a weight
      push is in progress.
    - ``reward(stage, keys) -> [float | None]``: one reward per key; ``None``
      (or NaN) marks a sample whose reward failed. An exception fails all.
    - ``logprob(stage, keys)``: compute and store the stage's logprob field.
    - ``begin_train_step(step)``, ``train_microbatch(step, keys) -> metrics``,
      ``finish_train_step(step) -> StepResult``, ``abort_train_step(step)``:
      the split-step trainer; microbatches read their fields (``advantage``
      included) from the data plane.
    - ``push_weights(version)``: bucketed transfer trainer -> every generator;
      the new version takes effect when the last bucket lands.
    - ``generator_version() -> int``: the generators' weight version at start.
    - ``sleep_generators()`` / ``wake_generators()``: release and reclaim the
      accelerator memory of generators that share GPUs with the trainer
      (``RunSettings.colocated``); no-ops otherwise.
    """

    generate: Callable[[Sequence[Prompt], Sequence[str], int, int], Awaitable[int]]
    reward: Callable[[str, Sequence[str]], Awaitable[Sequence[float | None]]]
    logprob: Callable[[str, Sequence[str]], Awaitable[None]]
    begin_train_step: Callable[[int], Awaitable[None]]
    train_microbatch: Callable[[int, Sequence[str]], Awaitable[Mapping[str, float]]]
    finish_train_step: Callable[[int], Awaitable[StepResult]]
    abort_train_step: Callable[[int], Awaitable[None]]
    push_weights: Callable[[int], Awaitable[None]]
    generator_version: Callable[[], Awaitable[int]]
    sleep_generators: Callable[[], Awaitable[None]] = _nothing
    wake_generators: Callable[[], Awaitable[None]] = _nothing
