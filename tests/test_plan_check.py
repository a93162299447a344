"""A saved plan is re-checked before it runs (rldsl/compiler/plan_check.py):
each hand edit a plan's numbers can carry is named with its rule code and
the plan field, `rldsl run --plan` refuses it at once, and plans the
compiler made pass clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_file
from rldsl.compiler.plan_check import check_plan, render_plan_findings
from rldsl.plan import ExecutionPlan

ROOT = Path(__file__).resolve().parent.parent


def plan_data(name: str = "sim_async") -> dict:
    return json.loads(compile_file(str(ROOT / "pipelines" / f"{name}.rlp")).plan.to_json())


def findings(data: dict) -> list[tuple[str, str, str]]:
    return [(f.code, f.severity, f.field) for f in check_plan(ExecutionPlan.from_json(json.dumps(data)))]


def rendered(data: dict) -> str:
    return render_plan_findings(check_plan(ExecutionPlan.from_json(json.dumps(data))), "plan.json")


@pytest.mark.parametrize("pipeline", sorted(p.stem for p in (ROOT / "pipelines").glob("*.rlp")))
def test_every_plan_the_compiler_makes_has_no_error(pipeline):
    result = compile_file(str(ROOT / "pipelines" / f"{pipeline}.rlp"))
    assert not [f for f in check_plan(result.plan) if f.is_error]


def test_a_buffer_below_one_step_is_the_deadlock_rlp304_with_the_compilers_words():
    data = plan_data()
    data["pipelines"][0]["batch"]["buffer_capacity"] = 2
    assert findings(data) == [("RLP304", "error", "pipelines[0].batch.buffer_capacity"),
                              ("RLP305", "warning", "pipelines[0].batch.max_inflight")]
    assert rendered(data) == (
        "error[RLP304]: buffer capacity 2 < 4 prompt groups per step: the rollout pump deadlocks\n"
        "  --> plan.json: pipelines[0].batch.buffer_capacity\n"
        "  = note: a step finishes only after 4 groups are trained, and trained groups stay stored until the "
        "step's single clear\n"
        "  = note: after 2 groups the buffer is full: the rollout pump waits for space, the train pump waits for "
        "group 3 of 4, and neither can move\n"
        "  = help: set capacity >= 4 (>= 8 to fill the max_lag = 1 window), or leave it out\n"
        "\n"
        "warning[RLP305]: max_inflight 4 > buffer capacity 2: the buffer caps in-flight groups first, so the limit "
        "is never reached\n"
        "  --> plan.json: pipelines[0].batch.max_inflight\n"
        "  = help: set max_inflight <= 2\n"
        "\n"
        "1 error, 1 warning in the plan; fix the pipeline file and re-create the plan with `rldsl plan FILE "
        "--out`, or correct the field\n")


def test_a_buffer_below_the_staleness_window_is_rlp306_a_warning():
    data = plan_data()
    data["pipelines"][0]["batch"]["buffer_capacity"] = 6
    data["pipelines"][0]["batch"]["max_inflight"] = 4
    assert findings(data) == [("RLP306", "warning", "pipelines[0].batch.buffer_capacity")]


def test_batch_arithmetic_rlp301_and_rlp302():
    data = plan_data()
    data["pipelines"][0]["batch"]["global_batch"] = 6  # not whole groups of 4
    assert ("RLP301", "error", "pipelines[0].batch.global_batch") in findings(data)
    data = plan_data()
    data["pipelines"][0]["batch"]["micro_batch"] = 3  # 16 over dp 2 x 3
    assert findings(data) == [("RLP302", "error", "pipelines[0].batch.micro_batch")]
    assert "global_batch = 16 is not divisible by micro_batch x dp = 3 x 2 = 6" in rendered(data)
    assert "micro_batch values that divide it: 1, 2, 4, 8" in rendered(data)


def test_gpu_ids_outside_the_cluster_are_rlp501():
    data = plan_data()
    data["pipelines"][0]["stages"][0]["ranks"][1]["gpus"] = [7]
    assert ("RLP501", "error", "pipelines[0].stages[0].ranks[1].gpus") in findings(data)
    assert "GPU 7 of node 0, which does not exist: the cluster has 1 node(s) of 4 GPUs (0..3)" in rendered(data)


def test_stages_that_borrow_actors_must_name_stages_that_have_them():
    data = plan_data("lora_many")
    served = data["pipelines"][1]["stages"][0]
    assert served["settings"]["served_by"] == "exact/rollout" and findings(data) == []
    served["settings"]["served_by"] = "exact/score"
    assert findings(data) == [("RLP514", "error", "pipelines[1].stages[0].settings.served_by")]
    data = plan_data("grpo_lora")
    reference = next(s for s in data["pipelines"][0]["stages"] if s["kind"] == "logprob")
    assert reference["settings"]["on_trainer"] == "actor" and findings(data) == []
    reference["settings"]["frozen"] = False
    assert [f[0] for f in findings(data)] == ["RLP104"]


def test_a_gpu_used_by_stages_that_are_not_colocated_is_rlp501():
    data = plan_data()
    data["pipelines"][0]["stages"][0]["ranks"][1]["gpus"] = [2]  # rollout onto the trainer's GPU
    assert findings(data) == [("RLP501", "error", "pipelines[0].stages[0].ranks[1]")]
    assert "GPU 2 of node 0 is used by `rollout` and `reference`, which are not colocated" in rendered(data)


def test_an_over_subscribed_gpu_is_rlp501():
    data = plan_data()
    data["pipelines"][0]["stages"][2]["ranks"][0]["gpu_fraction"] = 0.75  # reference 0.75 + actor 0.5
    assert findings(data) == [("RLP501", "error", "pipelines[0].stages[2].ranks[0]")]
    assert "gpu_fraction add up to 1.25" in rendered(data)


def test_ranks_that_do_not_tile_tp_pp_dp_are_rlp502():
    data = plan_data()
    data["pipelines"][0]["stages"][3]["dp"] = 4  # the trainer's two ranks
    assert ("RLP502", "error", "pipelines[0].stages[3].ranks") in findings(data)
    data = plan_data()
    data["pipelines"][0]["stages"][3]["ranks"][1]["dp_rank"] = 0  # two ranks at one position
    assert findings(data) == [("RLP502", "error", "pipelines[0].stages[3].ranks")]


def test_a_collective_sync_to_a_receiver_on_the_trainers_gpus_is_rlp511():
    data = plan_data("sim_partial_overlap")
    sync = next(i for i, s in enumerate(data["pipelines"][0]["stages"]) if s["kind"] == "sync")
    data["pipelines"][0]["stages"][sync]["settings"]["transport"] = "collective"
    assert findings(data) == [("RLP511", "error", f"pipelines[0].stages[{sync}].settings.transport")]
    assert "`rollout` shares GPUs with the trainer" in rendered(data)


def test_values_of_the_wrong_type_are_rlp104_not_a_traceback():
    data = plan_data()
    data["pipelines"][0]["batch"]["buffer_capacity"] = "eight"
    data["pipelines"][0]["staleness"]["max_lag"] = -1
    assert findings(data) == [("RLP104", "error", "pipelines[0].batch.buffer_capacity"),
                              ("RLP104", "error", "pipelines[0].staleness.max_lag")]
    data = plan_data()
    data["pipelines"][0]["batch"]["train_stage"] = "nobody"
    assert findings(data) == [("RLP104", "error", "pipelines[0].batch.train_stage")]


def test_run_refuses_a_hand_edited_plan_in_well_under_a_second_naming_the_rule(tmp_path):
    data = plan_data()
    data["pipelines"][0]["batch"]["buffer_capacity"] = 2
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rldsl", "run", "--plan", str(plan), "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"}, timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert "error[RLP304]: buffer capacity 2 < 4 prompt groups per step" in proc.stderr
    assert f"--> {plan}: pipelines[0].batch.buffer_capacity" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()  # nothing started
    assert elapsed < 30, elapsed  # a generous bound for a loaded machine; it takes ~0.2 s (Ray never starts)


def test_a_resumed_runs_plan_is_checked_too(tmp_path):
    data = plan_data()
    data["pipelines"][0]["batch"]["micro_batch"] = 3
    (tmp_path / "plan.json").write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, "-m", "rldsl", "run", "--resume", str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1 and "error[RLP302]" in proc.stderr, proc.stderr
