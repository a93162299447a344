"""`rldsl run` end to end, as a user runs it: a real local Ray, the real
TransferQueue data plane, one actor per planned rank."""

import json
from pathlib import Path

import pytest

from tests.runs import LEAN_SIM_ASYNC, rldsl_here, signalled_here
from tests.shared_runs import RLOO_STEPS, TORCH_STEPS

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray]


def run(args, tmp_path):
    """`rldsl run ARGS` in this process, on the session's Ray (tests/runs.py)."""
    return rldsl_here("run", *args, "--run-dir", str(tmp_path / "run")), tmp_path / "run"


def test_a_saved_plan_runs_exactly_and_the_ledger_balances(tmp_path):
    plan = tmp_path / "plan.json"
    assert rldsl_here("plan", "pipelines/sim_async.rlp", *LEAN_SIM_ASYNC, "--out", str(plan)).returncode == 0
    proc, run_dir = run(["--plan", str(plan), "--steps", "4"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "plan.json").read_text().strip() == plan.read_text().strip()
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["steps"] == 4
    assert ledger["generated"] == ledger["trained"] + sum(ledger["dropped"].values())
    assert summary["max_lag"] <= 1
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "step" in s and not s.get("eval")] == [1, 2, 3, 4]
    assert json.loads((run_dir / "plan.json").read_text())["pipelines"][0]["name"] == "sim_async"
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    stages = {e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert {"stage rollout", "stage score", "stage reference", "stage actor", "stage controller"} <= stages
    calls = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"generate", "reward", "logprob", "train_microbatch", "finish_train_step", "weight export",
            "weight receive", "weight push", "dataplane put", "dataplane get", "dataplane clear"} <= calls
    arrows_out, arrows_in = (sum(e["ph"] == phase for e in trace) for phase in ("s", "f"))
    assert arrows_in == 4 * 4 and arrows_out >= arrows_in  # generated groups -> the 16 trained


def test_partial_overlap_trains_only_while_the_replica_on_its_gpu_sleeps(tmp_path):
    proc, run_dir = run(["pipelines/sim_partial_overlap.rlp"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["ledger"]["open"] == 0
    spans = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"]
             if e["ph"] == "X" and e.get("cat") != "gpu"]

    def of(actor, *names):
        return [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["args"]["actor"] == actor and e["name"] in names]

    sleeps, wakes = of("rollout-0", "sleep"), of("rollout-0", "wake")
    asleep = [(sleep_end, next(start for start, _ in wakes if start >= sleep_end)) for _, sleep_end in sleeps]
    trainer = of("actor-0", "begin_train_step", "train_microbatch", "finish_train_step", "weight export")
    assert len(sleeps) == 6 and trainer
    for start, end in trainer:  # no trainer call while replica 0, on the trainer's GPU, is awake
        assert any(a <= start and end <= b for a, b in asleep), (start, end, asleep)
    other = of("rollout-1", "generate")
    assert any(s < b and a < e for s, e in other for a, b in asleep), "replica 1 never generated during a step"
    assert of("rollout-0", "weight refresh"), "replica 0 was never refreshed when it woke"


def test_torch_pipeline_trains_and_evaluates(torch_run):
    summary = torch_run.summary
    assert summary["steps"] == TORCH_STEPS and summary["version"] == TORCH_STEPS
    assert 0.0 <= summary["eval_start"] <= 1.0 and 0.0 <= summary["eval_end"] <= 1.0
    assert summary["ledger"]["trained"] == TORCH_STEPS * 16 * 8
    assert "held-out accuracy" in torch_run.stdout and "run directory:" in torch_run.stdout  # results: stdout
    assert "step 1/2" in torch_run.stderr and "step 1/2" not in torch_run.stdout  # progress: stderr


def test_mini_batches_rloo_packing_and_warmup_learn(rloo_tis_run):
    """(With the TIS correction on: test_rollout_correction reads the same run.)"""
    run_dir, summary = rloo_tis_run.run_dir, rloo_tis_run.summary
    assert RLOO_STEPS == 5 and summary["steps"] == 5 and summary["version"] == 5  # one version per rollout batch
    assert summary["ledger"]["trained"] == 5 * 16 * 8
    trainer = [json.loads(line)["trainer"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if "trainer" in json.loads(line)]
    assert [t["optimizer_steps"] for t in trainer] == [2] * 5
    lrs = [t["lr"] for t in trainer]
    assert lrs[0] < lrs[1] and max(lrs) <= 5e-4  # warming up over 4 of the run's 10 optimizer steps
    assert summary["eval_end"] > summary["eval_start"]


def test_ctrl_c_checkpoints_and_resume_continues_without_retraining(tmp_path):
    """Ctrl-C to this process, which runs the driver as `rldsl run` does (a
    SIGTERM to a real process: test_stops.py)."""
    import io
    import signal

    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"

    def three_steps() -> bool:
        return metrics.exists() and len([l for l in metrics.read_text().splitlines() if '"lag_histogram"' in l]) >= 3

    err_text = io.StringIO()
    proc, sent = signalled_here(["run", "pipelines/grpo_async.rlp", "--steps", "40", "--run-dir", str(run_dir)],
                                [(three_steps, signal.SIGINT)], err_text)
    err = err_text.getvalue()
    assert sent == [signal.SIGINT] and proc.returncode == 130, err[-3000:]
    assert "checkpoint saved at version" in proc.stdout  # how to resume: a result, on stdout
    (checkpoint,) = sorted((run_dir / "checkpoints").iterdir())[-1:]
    progress = json.loads((checkpoint / "progress.json").read_text())
    version = progress["version"]
    trained = progress["trained_prompts"]
    assert trained["below"] + len(trained["above"]) == version * 16  # every finished step's prompts, once
    stopped = json.loads((run_dir / "summary.json").read_text())  # written on Ctrl-C too
    assert stopped["evals"][0]["step"] == 0  # the evaluations made (or skipped) before the stop are in it
    assert stopped["exit"] == "stopped" and stopped["ledger"]["trained"] == version * 16 * 8

    resumed = rldsl_here("run", "--resume", str(run_dir), "--steps", str(version + 2))  # no signal: in this process
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint.name}" in resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == version + 2 and summary["version"] == version + 2
    assert summary["exit"] == "finished" and summary["resumes"] == 1
    assert summary["segment_ledger"]["trained"] == 2 * 16 * 8  # the resumed part
    assert summary["ledger"]["trained"] == (version + 2) * 16 * 8  # the whole run, from the journal
    audit = rldsl_here("audit", str(run_dir))
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert f"started, stopped; resumed after step {version}, finished" in audit.stdout


def test_watchdog_stops_a_plan_that_stalls(tmp_path):
    """A trainer whose every call takes a minute, edited into a saved plan
    (which passes its checks: nothing in it is impossible, only slow): the
    run must stop with the watchdog's words and exit 3, not hang. (An
    impossible buffer is refused before anything starts: test_plan_check.)"""
    plan_path = tmp_path / "plan.json"
    assert rldsl_here("plan", "pipelines/sim_async.rlp", *LEAN_SIM_ASYNC, "--out", str(plan_path)).returncode == 0
    plan = json.loads(plan_path.read_text())
    trainer = next(s for s in plan["pipelines"][0]["stages"] if s["kind"] == "train")
    trainer["engine"]["args"]["latency"] = 60.0
    plan["pipelines"][0]["run"]["watchdog_s"] = 5.0
    plan_path.write_text(json.dumps(plan))
    proc, _ = run(["--plan", str(plan_path)], tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "no progress for" in proc.stderr
    assert "Traceback" not in proc.stderr and "ray::" not in proc.stderr
