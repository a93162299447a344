"""The one rule for `transport = collective`: which trainers and weight
receivers can stream weights rank to rank. `check` (RLP511, on
declarations), the saved plan's re-check and the launcher all ask it, so
what checks is what launches. Pure: it knows neither the compiler nor the
runtime."""

from __future__ import annotations

from dataclasses import dataclass

# Engines that stream weights rank to rank: trainers that send buckets, and
# generate stages whose batcher applies a stream between two decode batches.
COLLECTIVE_TRAINERS = ("torch", "fsdp", "megatron", "sim")
COLLECTIVE_RECEIVERS = ("torch", "vllm", "sim")


@dataclass(frozen=True)
class WeightReceiver:
    """What decides whether a receiver can stand in a collective push
    (``engine`` None: not known yet, which blocks nothing)."""

    name: str
    kind: str
    engine: str | None
    shares_trainer_gpus: bool
    served_by: str | None = None  # another pipeline's generator serving this stage (`served_by`)


def collective_blocker(trainer: str, trainer_engine: str | None, receivers,
                       receivers_sleep: bool = False) -> str | None:
    """The one rule for `transport = collective` (RLP511 in `check`, the saved
    plan's re-check and the launcher's choice): why weights cannot go rank to
    rank, or None when they can."""
    if trainer_engine is not None and trainer_engine not in COLLECTIVE_TRAINERS:
        return f"trainer `{trainer}` uses engine `{trainer_engine}`, which does not stream buckets"
    for receiver in sorted(receivers, key=lambda r: r.name):
        if receiver.served_by:
            return f"`{receiver.name}` is served by `{receiver.served_by}`'s generator, which takes each pipeline's " \
                   "adapters through the object store"
        if receiver.kind != "generate":
            return f"`{receiver.name}` is a {receiver.kind} stage, which takes weights only between its calls"
        if receiver.engine is not None and receiver.engine not in COLLECTIVE_RECEIVERS:
            return f"`{receiver.name}` uses engine `{receiver.engine}`, which takes weights only through the " \
                   "object store"
        if receiver.shares_trainer_gpus:
            return f"`{receiver.name}` shares GPUs with the trainer, so it sleeps while the trainer runs"
    if receivers_sleep:
        return "its receivers sleep (partial overlap or GPUs leased from another pipeline) and would miss pushes"
    return None
