"""The ``sim`` engine family: the engine protocols without models.

This module is the entry point and re-exports the public names, so callers
import everything from here. The family is split by concept: the latency
model in ``sim_latency``, the engines (generator, reward worker, logprob,
dry-run split-step trainer) in ``sim_engines``, and the in-process
``StageHandles`` over them (``SimStages``) in ``sim_stages``.
"""

from __future__ import annotations

from rldsl.runtime.engines.sim_engines import (
    SimFailure,
    SimGenerator,
    SimLogprob,
    SimRewardWorker,
    SimTrainer,
    SplitStepError,
)
from rldsl.runtime.engines.sim_latency import Latency
from rldsl.runtime.engines.sim_stages import TRAIN_FIELDS, SimConfig, SimStages, sim_stage_handles

__all__ = [
    "TRAIN_FIELDS",
    "Latency",
    "SimConfig",
    "SimFailure",
    "SimGenerator",
    "SimLogprob",
    "SimRewardWorker",
    "SimStages",
    "SimTrainer",
    "SplitStepError",
    "sim_stage_handles",
]
