"""The ``sim`` engine family: the engine protocols without models.

The latency model is in ``latency``, the engines (generator, reward worker,
logprob, dry-run split-step trainer) in ``engines``. The in-process
``StageHandles`` that drive them without Ray are a lowering, not an engine:
``rldsl.runtime.inprocess``.
"""

from __future__ import annotations

from rldsl.runtime.engines.sim.engines import (
    SimFailure,
    SimGenerator,
    SimLogprob,
    SimRewardWorker,
    SimTrainer,
    SplitStepError,
)
from rldsl.runtime.engines.sim.latency import Latency

__all__ = [
    "Latency",
    "SimFailure",
    "SimGenerator",
    "SimLogprob",
    "SimRewardWorker",
    "SimTrainer",
    "SplitStepError",
]
