"""Step metrics to TensorBoard, W&B (offline) and MLflow (a file store),
through their own libraries, under the report's names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rldsl.runtime.ray_lowering.loggers import MetricLoggers, missing_libraries, step_scalars
from tests.shared_runs import SIM_OVERRIDES

ROOT = Path(__file__).resolve().parent.parent
RECORD = {"step": 3, "trainer": {"loss": 0.5, "grad_norm": 1.25, "skipped": False}, "samples_per_s": 40.0,
          "step_time_s": 2.0, "reward_mean": 0.25, "lag_histogram": {"0": 3, "1": 1}}


def test_a_step_record_becomes_the_reports_scalars():
    assert step_scalars(RECORD) == {"train/loss": 0.5, "train/grad_norm": 1.25, "run/samples_per_s": 40.0,
                                    "run/step_time_s": 2.0, "run/reward_mean": 0.25, "run/mean_lag": 0.25}


def _mlflow_history(run_dir: Path, name: str) -> list[tuple[int, float]]:
    import mlflow

    from rldsl.runtime.ray_lowering.loggers import default_mlflow_uri

    client = mlflow.MlflowClient(default_mlflow_uri(run_dir))
    run_id = (run_dir / ".mlflow_run_id").read_text().strip()
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))


def test_every_backend_records_the_steps_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    loggers = MetricLoggers(["tensorboard", "wandb", "mlflow"], tmp_path, "demo", {"lr": 1e-5})
    assert set(loggers.backends) == {"tensorboard", "wandb", "mlflow"}
    loggers.log(step_scalars(RECORD), 3)
    loggers.log({"eval/accuracy": 0.5}, 3)
    loggers.close()
    resumed = MetricLoggers(["wandb", "mlflow"], tmp_path, "demo")
    resumed.log({"run/samples_per_s": 42.0}, 4)
    resumed.close()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/loss", "run/mean_lag", "eval/accuracy"} <= set(events.Tags()["scalars"])
    assert _mlflow_history(tmp_path, "run/samples_per_s") == [(3, 40.0), (4, 42.0)]  # one run, resumed
    offline = list((tmp_path / "wandb").glob("offline-run-*"))
    wandb_id = (tmp_path / ".wandb_id").read_text().strip()
    assert offline and all(run.name.endswith(wandb_id) for run in offline)


def test_a_logger_that_fails_is_dropped_not_the_run(tmp_path):
    loggers = MetricLoggers(["tensorboard"], tmp_path, "demo")

    class Broken:
        def log(self, scalars, step):
            raise OSError("disk full")

    loggers.backends["broken"] = Broken()
    loggers.log({"run/x": 1.0}, 1)
    assert set(loggers.backends) == {"tensorboard"}
    loggers.close()


def test_a_missing_library_is_named_with_its_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert missing_libraries(["tensorboard", "wandb"]) == [
        "`log = [wandb]` needs the wandb package: pip install 'rldsl[wandb]'"]


def test_the_language_takes_the_backends():
    from rldsl.compiler.driver import compile_source

    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text().replace("checkpoint_every = 20",
                                                                       "checkpoint_every = 20  log = [mlflow, wandb]")
    assert compile_source(text, "p.rlp").plan.pipeline().run.log == ["mlflow", "wandb"]
    bad = compile_source(text.replace("log = [mlflow, wandb]", "log = [comet]"), "p.rlp")
    assert [d.code for d in bad.diagnostics] == ["RLP104"]


@pytest.mark.ray
def test_a_run_logs_to_mlflow(sim_run_with_overrides):
    assert "run.log=[mlflow]" in SIM_OVERRIDES and "run.steps=5" in SIM_OVERRIDES
    run_dir = sim_run_with_overrides.run_dir
    assert [step for step, _ in _mlflow_history(run_dir, "run/samples_per_s")] == [1, 2, 3, 4, 5]
    assert not (run_dir / "tensorboard").exists()  # only what `log` names
    assert len([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]) >= 3


@pytest.mark.ray
def test_tensorboard_holds_the_final_evaluation_that_summary_json_reports(torch_run):
    """The loggers close after the run's final evaluation, not before it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(torch_run.run_dir / "tensorboard"))
    events.Reload()
    logged = {event.step: event.value for event in events.Scalars("eval/accuracy")}
    evals = {e["step"]: e["accuracy"] for e in torch_run.summary["evals"]}
    assert sorted(evals) == [0, torch_run.summary["steps"]]  # at the start and at the end
    assert logged == pytest.approx(evals)
