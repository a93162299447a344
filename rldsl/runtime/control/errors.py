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
        self.error = error
