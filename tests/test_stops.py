"""Every way a run can stop leaves it resumable and accounted.

SIGTERM (a scheduler), SIGHUP (a closed terminal) and Ctrl-C stop a run at
a safe point, checkpoint the last finished step, write summary.json and exit
with the shell's code; a second signal still gets summary.json written.
metrics.jsonl keeps one record per step across a resume and a restart, and
`rldsl report` reads a run that died at any point.

The stopped runs are driven in a subprocess, as a user runs them (the signal
is the subject); every wait polls files with generous timeouts, so a loaded
2-core machine only makes it slower. A restart after a lost trainer is in
test_supervision.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runs import lean_chaos, rldsl_here, signalled_here

ROOT = Path(__file__).resolve().parent.parent
CHAOS = (ROOT / "pipelines" / "sim_chaos.rlp").read_text()
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
STEPS = 12
SAMPLES_PER_STEP = 4 * 4  # prompts_per_step x samples_per_prompt of sim_chaos


def pipeline(tmp_path: Path, steps: int = STEPS, checkpoint_every: int = 25, train_latency: str = "20ms") -> Path:
    source = tmp_path / "chaos.rlp"
    source.write_text(lean_chaos(CHAOS).replace("steps = 600", f"steps = {steps}")
                      .replace("checkpoint_every = 25", f"checkpoint_every = {checkpoint_every}")
                      .replace("engine = sim(latency = 20ms)", f"engine = sim(latency = {train_latency})")
                      .replace("watchdog = 120s", "watchdog = 300s"))
    return source


class Run:
    """`rldsl run` in a subprocess, its stderr in a file (a pipe could fill while the test waits)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self._file = open(log, "w")
        self.process = subprocess.Popen([sys.executable, "-m", "rldsl", "run", *args], cwd=ROOT, env=ENV,
                                        stdout=self._file, stderr=subprocess.STDOUT)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, condition, what: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return
            if self.process.poll() is not None:
                raise AssertionError(f"the run ended before {what}: {self.stderr()[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}: {self.stderr()[-3000:]}")

    def finish(self, timeout_s: float = 300) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self._file.close()


def step_records(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if not r.get("eval")]


def audit(run_dir: Path) -> subprocess.CompletedProcess:
    return rldsl_here("audit", str(run_dir))


@pytest.mark.ray
def test_a_signal_stops_checkpoints_and_the_resumed_run_finishes_with_one_record_per_step(tmp_path):
    """SIGTERM, as a scheduler sends it, to the process; SIGHUP takes the same path
    (test_every_stop_signal_raises_its_own_interrupt)."""
    signum, code = signal.SIGTERM, 143
    run_dir = tmp_path / "run"
    run = Run([str(pipeline(tmp_path)), "--run-dir", str(run_dir)], tmp_path / "run.log")
    run.wait_for(lambda: len(step_records(run_dir)) >= 2, "step 2")
    recorded_at_signal = len(step_records(run_dir))
    run.process.send_signal(signum)
    assert run.finish() == code, run.stderr()[-3000:]
    stderr = run.stderr()
    assert "Traceback" not in stderr

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit"] == "stopped" and summary["signal"] == signal.Signals(signum).name
    checkpoints = sorted((run_dir / "checkpoints").iterdir())
    version = json.loads((checkpoints[-1] / "progress.json").read_text())["version"]
    assert (checkpoints[-1] / "trainer.json").exists()
    # the last finished step is checkpointed and recorded: nothing finished before the signal is lost
    assert version >= recorded_at_signal and summary["steps"] == version
    assert step_records(run_dir) == list(range(1, version + 1))
    assert summary["ledger"]["trained"] == version * SAMPLES_PER_STEP
    assert f"continue with `rldsl run --resume {run_dir}`" in stderr

    resumed = rldsl_here("run", "--resume", str(run_dir))  # the resume is no signal's business: in this process
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert step_records(run_dir) == list(range(1, STEPS + 1))  # exactly one record per step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit"] == "finished" and summary["steps"] == STEPS
    checked = audit(run_dir)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.ray
def test_a_second_ctrl_c_during_the_stop_still_writes_the_summary(tmp_path):
    """A 3 s trainer call is in flight when the stop begins; the second
    Ctrl-C comes while the stop waits for it (both to this process, which
    runs the driver as `rldsl run` does: its handlers in the main thread)."""
    run_dir = tmp_path / "run"
    err = io.StringIO()
    interrupts = [(lambda: len(step_records(run_dir)) >= 1, signal.SIGINT),
                  (lambda: "stopping after the trainer call in flight" in err.getvalue(), signal.SIGINT)]
    result, sent = signalled_here(["run", str(pipeline(tmp_path, train_latency="3s")), "--run-dir", str(run_dir)],
                                  interrupts, err)
    assert sent == [signal.SIGINT, signal.SIGINT], err.getvalue()[-3000:]
    assert result.returncode == 130, err.getvalue()[-3000:]
    stderr = err.getvalue()
    assert "Ctrl-C again" in stderr and "Traceback" not in stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit"] == "stopped" and summary["signal"] == "Ctrl-C"
    assert summary["steps"] >= 1 and step_records(run_dir)[0] == 1


# ------------------------------------------------- without Ray: the pieces


@pytest.mark.parametrize("summary", [None, "{\"exit\": \"stop", {"pipeline": "chaos", "exit": "failed",
                                     "error": "the controller ended without a summary (its actor died?)",
                                     "ledger": None, "segment_ledger": None},
                                     {"exit": "failed", "ledger": {"generated": 32, "trained": 16, "dropped": {}}}])
def test_report_reads_a_run_that_died_at_any_point(tmp_path, capsys, summary):
    """No summary.json, a torn one, one from a controller that died (no
    samples_per_s, no ledger), one without max_lag: a report, no traceback."""
    pytest.importorskip("matplotlib")
    from rldsl.report import write_report

    record = {"step": 1, "version": 1, "lag_histogram": {"0": 16}, "samples_per_s": 9.5, "reward_mean": 0.5,
              "busy": {}, "samples": 16, "step_time_s": 1.0}
    lines = [json.dumps(record), json.dumps({**record, "reward_mean": 0.75}), json.dumps({**record, "step": 2}),
             '{"step": 3, "vers']  # a repeated step, and the line a killed run left torn
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    if isinstance(summary, dict):
        (tmp_path / "summary.json").write_text(json.dumps(summary))
    elif isinstance(summary, str):
        (tmp_path / "summary.json").write_text(summary)
    assert write_report(tmp_path) == 0
    out = capsys.readouterr().out
    assert "steps: 2" in out and (tmp_path / "report.png").exists()
    assert "mean reward: 0.750 (first step)" in out


def test_a_resume_rewinds_metrics_to_its_checkpoint(tmp_path):
    from rldsl.runtime.ray_lowering.progress import rewind_metrics

    records = [{"eval": True, "step": 0, "accuracy": 0.25}] + [{"step": s} for s in (1, 2, 3, 4)]
    records.append({"eval": True, "step": 4, "accuracy": 0.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 5, "la')
    rewind_metrics(tmp_path, 2)
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [{"eval": True, "step": 0, "accuracy": 0.25}, {"step": 1}, {"step": 2}]


@pytest.mark.parametrize(("signum", "name", "code"), [(signal.SIGTERM, "SIGTERM", 143), (signal.SIGHUP, "SIGHUP", 129),
                                                      (signal.SIGINT, "Ctrl-C", 130)])
def test_every_stop_signal_raises_its_own_interrupt(signum, name, code):
    """What the driver's handlers do with each signal they take (the whole
    stop after it is the same for all: test_a_signal_stops_checkpoints...)."""
    from rldsl.runtime.ray_lowering.stopping import RunInterrupted, StopSignals

    signals = StopSignals(grace_s=60)
    signals.install()
    try:
        with pytest.raises(RunInterrupted) as raised:
            os.kill(os.getpid(), signum)
            time.sleep(1)  # the handler runs in this thread, between two bytecodes
        assert str(raised.value) == name and raised.value.exit_code == code == signals.exit_code
    finally:
        signals.restore()


def test_exit_codes_and_the_resume_command_repeat_what_the_plan_does_not_keep():
    from rldsl.runtime.ray_lowering.stopping import RunInterrupted, resume_command

    assert [RunInterrupted(s).exit_code for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)] == [130, 143, 129]
    assert resume_command(Path("/r")) == "rldsl run --resume /r"
    assert resume_command(Path("/r x"), steps=40, address="10.0.0.1:6379", grace_s=60) == \
        "rldsl run --resume '/r x' --steps 40 --address 10.0.0.1:6379 --grace 60s"


def test_the_help_after_a_failure_says_why_there_is_no_checkpoint(tmp_path):
    from rldsl.compiler.driver import compile_source
    from rldsl.runtime.ray_lowering.stopping import how_to_resume

    plan = compile_source(CHAOS, "chaos.rlp").plan  # checkpoint_every = 25
    hint = how_to_resume(tmp_path, plan, "rldsl run --resume R")
    assert "set `run { checkpoint_every" not in hint and "checkpoint_every = 25 }` saves after step 25" in hint
    plan = compile_source(CHAOS.replace("  checkpoint_every = 25", ""), "chaos.rlp").plan
    assert "set `run { checkpoint_every = N }`" in how_to_resume(tmp_path, plan, "rldsl run --resume R")
    checkpoint = tmp_path / "checkpoints" / "v000003"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer.json").write_text("{}")
    (checkpoint / "progress.json").write_text("{}")
    assert how_to_resume(tmp_path, plan, "rldsl run --resume R") == "`rldsl run --resume R` continues from v000003"
