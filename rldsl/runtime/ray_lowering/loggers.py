"""Step metrics where users look: TensorBoard, Weights & Biases, MLflow.

`run { log = [tensorboard, wandb, mlflow] }` picks them (TensorBoard by
default); metrics.jsonl is always written. Every backend gets the same
names as the report: `train/<trainer metric>`, `run/samples_per_s`,
`run/step_time_s`, `run/reward_mean`, `run/mean_lag`, `eval/accuracy`, and
`reward/<name>` for each named reward component.

Each goes through its own library, configured the way its users expect:
- W&B: `WANDB_PROJECT` (default `rldsl`) and `WANDB_MODE`; with no API key
  and no mode it runs offline into RUN_DIR/wandb (`wandb sync` uploads it).
  A resumed run continues the same W&B run (its id is kept in the run dir).
- MLflow: `MLFLOW_TRACKING_URI`, else a SQLite store, RUN_DIR/mlflow.db
  (`mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db`; MLflow's
  file store is in maintenance mode); the experiment is the pipeline's
  name; a resumed run continues its MLflow run.
A backend whose library is missing is refused before Ray starts
(`missing_libraries`); one that fails mid-run is reported once and
dropped, never the run.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # backend -> module it needs
EXTRAS = {"tensorboard": "run", "wandb": "wandb", "mlflow": "mlflow"}  # backend -> the rldsl extra that installs it


def missing_libraries(backends) -> list[str]:
    """What `pip install` a run's `log` still needs, one line each."""
    return [f"`log = [{name}]` needs the {BACKENDS[name]} package: pip install 'rldsl[{EXTRAS[name]}]'"
            for name in backends if importlib.util.find_spec(BACKENDS[name]) is None]


def step_scalars(record: dict) -> dict[str, float]:
    """One step record (metrics.jsonl) as the backends' scalars."""
    scalars = {name if name.startswith("mismatch/") else f"train/{name}": float(value)
               for name, value in record.get("trainer", {}).items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    for name in ("samples_per_s", "step_time_s", "reward_mean"):
        if isinstance(record.get(name), (int, float)):
            scalars[f"run/{name}"] = float(record[name])
    for name, value in (record.get("reward_components") or {}).items():  # a reward stage's named components
        if isinstance(value, (int, float)):
            scalars[f"reward/{name}"] = float(value)
    for name, value in (record.get("episode_stats") or {}).items():  # episodes' turns and tool calls
        if isinstance(value, (int, float)):
            scalars[f"episode/{name}"] = float(value)
    lags = record.get("lag_histogram") or {}
    if lags:
        scalars["run/mean_lag"] = sum(int(k) * v for k, v in lags.items()) / (sum(lags.values()) or 1)
    return scalars


class MetricLoggers:
    """The run's backends; ``log(scalars, step)`` sends to every one still working."""

    def __init__(self, backends, run_dir: Path, name: str, config: dict | None = None,
                 first_step: int | None = None) -> None:
        """``first_step``: a resumed run starts here. TensorBoard purges its
        events from it on; MLflow keeps both values of a re-trained step
        (its history is per step and time); W&B ignores steps it has seen
        (its steps only increase), so it resumes after the highest."""
        self.backends, self.closed = {}, False
        for backend in backends:
            try:
                self.backends[backend] = _OPEN[backend](Path(run_dir), name, config or {}, first_step)
            except Exception as error:  # noqa: BLE001 - a logger never stops a run
                log.warning("metrics logger %s could not start (%s: %s); the run goes on without it",
                            backend, type(error).__name__, error)

    def log(self, scalars: dict[str, float], step: int) -> None:
        if self.closed:  # a record after the run's last: say so rather than drop it silently
            log.warning("metrics at step %d after the loggers closed are not logged: %s", step, sorted(scalars))
            return
        for backend, sink in list(self.backends.items()):
            try:
                sink.log(scalars, step)
            except Exception as error:  # noqa: BLE001
                log.warning("metrics logger %s failed (%s: %s); it is dropped", backend, type(error).__name__, error)
                self.backends.pop(backend)

    def close(self) -> None:
        for sink in self.backends.values():
            try:
                sink.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        self.backends, self.closed = {}, True


class _TensorBoard:
    def __init__(self, run_dir: Path, name: str, config: dict, first_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, name: str, config: dict, first_step: int | None = None) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or (None if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rldsl"), name=f"{name} {run_dir.name}",
                              dir=str(run_dir), id=_kept_id(run_dir / ".wandb_id", _new_wandb_id), resume="allow",
                              config=config, mode=mode)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, run_dir: Path, name: str, config: dict, first_step: int | None = None) -> None:
        import mlflow

        self.client = mlflow.MlflowClient(os.environ.get("MLFLOW_TRACKING_URI") or default_mlflow_uri(run_dir))
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        kept = run_dir / ".mlflow_run_id"
        self.run_id = kept.read_text().strip() if kept.exists() else None
        if self.run_id is None:
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            kept.write_text(self.run_id + "\n")
            for key, value in config.items():
                self.client.log_param(self.run_id, key, value)

    def log(self, scalars: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def default_mlflow_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def _kept_id(path: Path, new) -> str:
    """An id kept in the run directory, so a resumed run continues the same tracked run."""
    if path.exists():
        return path.read_text().strip()
    value = new()
    path.write_text(value + "\n")
    return value


def _new_wandb_id() -> str:
    import uuid

    return uuid.uuid4().hex[:8]


_OPEN = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}
