"""The interface between the control plane and a lowering: ``StageHandles``.

The controller drives stages only through these async callables; the Ray
lowering implements them over actors (``ray_lowering.stage_handles``), the
in-process lowering over sim engines (``inprocess.sim_stages``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Sequence

from rldsl.runtime.protocols import Generated, Prompt, RewardFailure, StepResult


async def _nothing(*_args) -> None:
    return None


@dataclass(frozen=True)
class StageHandles:
    """The async callables the controller drives.

    Only keys and metadata cross this boundary: engines read and write the
    sample fields in the data plane themselves.

    - ``generate(replica, prompts, keys, samples_per_prompt, seed) -> Generated``:
      generate ``samples_per_prompt`` responses per prompt on generator
      replica ``replica``, write them under ``keys`` (prompt-major), and
      report the weight version used. The controller keeps several groups
      in flight per replica; the replica batches them (continuous batching)
      and answers each call as its group completes.
    - ``reward(stage, keys) -> [float | RewardFailure | None]``: one reward
      per key; a ``RewardFailure`` says why a sample has none (its reason is
      the ledger's drop reason), ``None`` that it failed without a reason, a
      non-finite value is ``reward_invalid``. An exception fails all.
    - ``logprob(stage, keys) -> [int] | None``: compute and store the
      stage's logprob field; a policy stage may report, per key, the weight
      version it scored with (the journal records it). ``logprob(stage, keys,
      version)``: a policy stage scores every row with that pushed version
      (``recompute = batch_start``: the trainer's, at the step's start).
    - ``begin_train_step(step)``, ``train_microbatch(step, keys, replica) ->
      metrics``, ``finish_train_step(step) -> StepResult``,
      ``abort_train_step(step)``: the split-step trainer. Begin, finish and
      abort involve every rank; a microbatch goes to one data-parallel
      replica (its tp x pp ranks). The controller sends one replica at most
      one microbatch at a time and awaits them all before finish or abort.
      A microbatch's metrics may name ``refused_keys``: rows the trainer's
      fence kept out of the loss (stale behaviour logprobs), which the
      controller then drops as ``stale_logprobs`` instead of trained.
      Microbatches read their fields (``advantage`` included) from the data
      plane.
    - ``export_weights(version)``: snapshot the trainer's weights, once per
      step, into the host bucket cache that pushes and refreshes read (or,
      rank to rank, stream them to every receiver: the export is the push).
    - ``export_overlaps``: the export may run while the next step fills and
      trains (its microbatches only read the weights): no forward of the
      trainer swaps the parameters the export reads, and the export's
      collectives, if any, are not on the groups the step uses. The
      controller then awaits the export before anything that changes the
      weights (an optimizer step, the step's finish, the trainer's sleep)
      and before the next export.
    - ``push_weights(version, replicas)``: send the cached version to those
      generator replicas (and every other weight receiver). A replica stages
      the buckets while it keeps generating and swaps them in between two
      batches, so a push never stops the fleet.
    - ``generator_version() -> int``: the generators' weight version at start.
    - ``sleep_generators(replicas)`` / ``wake_generators(replicas, version)``:
      release and reclaim the accelerator memory of those generator
      replicas (they share GPUs with the trainer or another pipeline); a
      woken replica is refreshed from the host bucket cache to ``version``
      before it serves. Each returns once the memory is released or taken.
    - ``sleep_trainer()`` / ``wake_trainer()``: the trainer offloads its
      state for generation and takes its GPUs back for a step (engines
      that cannot offload do nothing).
    - ``generator_replicas`` / ``train_replicas``: how many replicas the
      controller schedules over.
    - ``stage_slots``: reward or logprob stage -> how many calls it serves
      at once (its workers or replicas). The controller runs that many and
      merges the groups waiting meanwhile into the next call; a stage not
      named takes every call as it comes.
    - ``decoded_tokens() -> [int]``: the tokens each generator replica has
      decoded so far, as it goes (not only when a group ends); the watchdog
      counts any change as progress. None: only finished work counts.
    - ``abort_generation()``: the run has ended (finished, stopped or
      failed): every group still decoding ends now, with what it has (engines
      that cannot abort let theirs run out), so nothing decodes for nobody.
    """

    generate: Callable[[int, Sequence[Prompt], Sequence[str], int, int], Awaitable[Generated]]
    reward: Callable[[str, Sequence[str]], Awaitable[Sequence[float | RewardFailure | None]]]
    logprob: Callable[..., Awaitable[Sequence[int] | None]]  # (stage, keys[, version])
    begin_train_step: Callable[[int], Awaitable[None]]
    train_microbatch: Callable[[int, Sequence[str], int], Awaitable[dict]]
    finish_train_step: Callable[[int], Awaitable[StepResult]]
    abort_train_step: Callable[[int], Awaitable[None]]
    export_weights: Callable[[int], Awaitable[None]]
    push_weights: Callable[[int, Sequence[int]], Awaitable[None]]
    generator_version: Callable[[], Awaitable[int]]
    sleep_generators: Callable[[Sequence[int]], Awaitable[None]] = _nothing
    wake_generators: Callable[[Sequence[int], int], Awaitable[None]] = _nothing
    sleep_trainer: Callable[[], Awaitable[None]] = _nothing
    wake_trainer: Callable[[], Awaitable[None]] = _nothing
    generator_replicas: int = 1
    train_replicas: int = 1
    stage_slots: Mapping[str, int] = field(default_factory=dict)
    optimizer_step: Callable[[int], Awaitable[dict]] | None = None
    decoded_tokens: Callable[[], Awaitable[Sequence[int]]] | None = None
    abort_generation: Callable[[], Awaitable[None]] = _nothing
    export_overlaps: bool = False
