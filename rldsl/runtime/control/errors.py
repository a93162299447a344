"""How a run of the control plane ends other than by finishing."""

from __future__ import annotations


class PipelineStalled(RuntimeError):
    """No pump made progress for ``watchdog_timeout_s``."""


class StepFailed(RuntimeError):
    """Too many consecutive train steps aborted."""


class StopRequested(Exception):
    """``Controller.request_stop`` was called: the open step ends unfinished."""


class TrainCallFailed(Exception):
    """A trainer or data-plane call of the open step raised."""

    def __init__(self, call: str, error: BaseException):
        super().__init__(f"{call} failed: {error!r}")
        self.call, self.error = call, error


class WorkerLost(RuntimeError):
    """A stage's actor died and could not be replaced (or its replacement
    died too): the samples it held are dropped as ``worker_died``."""

    def __init__(self, stage: str, rank: int, detail: str, replica: int | None = None):
        super().__init__(f"{stage}-{rank} was lost: {detail}")
        self.stage, self.rank, self.detail = stage, rank, detail
        self.replica = replica  # the generator replica index, when it was one


class TrainerLost(StepFailed):
    """A trainer rank died: its optimizer state is gone, so the run ends
    (resume it from the last checkpoint)."""


def trainer_lost(lost: WorkerLost, call: str) -> TrainerLost:
    return TrainerLost(f"trainer rank {lost.rank} of `{lost.stage}` died during {call} ({lost.detail}); "
                       "its optimizer state is gone: resume from the run's last checkpoint")


class ControllerLost(StepFailed):
    """The controller's process died (killed, out of memory, crashed): the
    run ends with the steps and checkpoints it made."""


class SchedulerLost(RuntimeError):
    """The cluster's GPU lease scheduler is gone: no pipeline sharing GPUs can
    know whose turn it is, so each stops (the run's summary names it)."""
