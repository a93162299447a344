"""The in-process lowering: the controller's ``StageHandles`` over sim
engines on the controller's own event loop, for tests and benchmarks that
drive a whole pipeline without Ray."""

from rldsl.runtime.inprocess.sim_stages import TRAIN_FIELDS, GpuBoard, SimConfig, SimStages, sim_stage_handles

__all__ = ["TRAIN_FIELDS", "GpuBoard", "SimConfig", "SimStages", "sim_stage_handles"]
