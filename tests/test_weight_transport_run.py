"""`rldsl run` with `transport = collective`: weights go rank to rank over a
gloo group of the trainer and the generator replicas, on a real local Ray."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.runs import rldsl_here, shared_ray
from tests.test_supervision import run_and_kill

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray]

STEPS = 4
BUCKET = 65536  # 64KiB: the tiny model (~430 KB in fp32) travels in several buckets


def collective_pipeline(eval_size: int, trainer: str = "torch") -> str:
    """The default pipeline with two generator replicas fed rank to rank; ``trainer = "fsdp"``: two fsdp
    ranks train."""
    source = (ROOT / "pipelines" / "grpo_async.rlp").read_text()
    if trainer == "fsdp":
        source = (source.replace("gpus_per_node = 2 ", "gpus_per_node = 4 ")
                  .replace("  engine = torch\n  gpus = 1\n  prompts_per_step", "  engine = fsdp\n  gpus = 2\n"
                                                                             "  prompts_per_step"))
    else:
        source = source.replace("gpus_per_node = 2 ", "gpus_per_node = 3 ")
    return (source.replace("  gpus = 1\n  samples_per_prompt = 8", "  gpus = 2\n  samples_per_prompt = 8")
            .replace("bucket = 64MiB }", "bucket = 64KiB  transport = collective }")
            .replace("eval_size = 128", f"eval_size = {eval_size}")
            .replace("steps = 40", f"steps = {STEPS}").replace("eval_every = 10", "eval_every = 2")
            .replace("checkpoint_every = 20", "checkpoint_every = 0"))


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _audit(run_dir: Path):
    return rldsl_here("audit", str(run_dir))


@pytest.mark.parametrize("trainer", ["torch", "fsdp"])
def test_a_run_streams_every_version_rank_to_rank(tmp_path, trainer):
    source = tmp_path / "collective.rlp"
    source.write_text(collective_pipeline(eval_size=0, trainer=trainer))
    proc = rldsl_here("run", str(source), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "weights: collective (asked for, rank to rank over gloo)" in proc.stderr
    summary = _summary(tmp_path / "run")
    transport = summary["weight_transport"]
    assert transport["transport"] == "collective" and transport["failed_pushes"] == 0
    push = transport["last_push"]
    assert push["buckets"] >= 4 and push["peak_held_bytes"] <= 2 * BUCKET + 4096  # two buckets in flight
    ledger = summary["ledger"]
    assert summary["steps"] == STEPS and ledger["open"] == 0 and ledger["trained"] == ledger["generated"]
    events = json.loads((tmp_path / "run" / "trace.json").read_text())["traceEvents"]
    receives = [e for e in events if e["ph"] == "X" and e["name"] == "weight receive" and e.get("cat") != "gpu"]
    assert {e["args"]["actor"] for e in receives} == {"rollout-0", "rollout-1"}
    assert all(e["args"]["transport"] == "collective" for e in receives)
    assert len(receives) == 2 * STEPS  # every version, to both replicas, and nothing through the object store
    _assert_pushes_off_the_critical_path(events, trainer_ranks=2 if trainer == "fsdp" else 1)
    audit = _audit(tmp_path / "run")
    assert audit.returncode == 0, audit.stdout + audit.stderr  # every sample's lag in bound


def _assert_pushes_off_the_critical_path(events: list[dict], trainer_ranks: int) -> None:
    """The trainer's timeline: the step after a push trains while the push
    streams (torch and fsdp trainers export beside their steps), and nothing that
    changes the weights (an optimizer step, a step's finish) runs during one."""
    def spans(name: str) -> list[tuple[int, int, dict]]:
        return [(e["ts"], e["ts"] + e["dur"], e["args"]) for e in events
                if e["ph"] == "X" and e["name"] == name and e.get("cat") != "gpu"]

    exports = [(start, end, args) for start, end, args in spans("weight export")
               if args.get("transport") == "collective"]
    assert Counter(args["actor"] for _, _, args in exports) == {f"actor-{rank}": STEPS for rank in range(trainer_ranks)}
    pushes = [(start, end) for start, end, _ in exports]  # every rank gathers its part of each push
    changes = spans("finish_train_step") + spans("optimizer_step")
    assert not [(s, e) for s, e, _ in changes if any(p < e and s < q for p, q in pushes)]  # the fence
    overlapped = [args["step"] for s, _, args in spans("train_microbatch") if any(p < s < q for p, q in pushes)]
    assert overlapped, "no microbatch started while a push streamed"


def test_a_killed_generator_is_replaced_and_the_group_forms_anew(tmp_path):
    """Joined as a cluster (`--address`: the group meets through a TCP store):
    a generator killed mid-run is replaced from the evaluator's object-store
    copy, the push it broke goes through the object store, and the last
    version streams to the group formed anew, the replacement included."""
    address = shared_ray().address
    result, run_dir = run_and_kill(tmp_path, "rollout-1", text=collective_pipeline(eval_size=16),
                                   args=("--address", address))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recovered: rollout-1 died" in result.stderr
    summary = _summary(run_dir)
    assert summary["steps"] == STEPS and summary["ledger"]["open"] == 0
    transport = summary["weight_transport"]
    assert transport["transport"] == "collective" and transport["lost_receivers"] == 0
    assert transport["failed_pushes"] <= 1  # the push the kill broke went through the object store
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    last = {e["args"]["actor"]: e["args"].get("transport") for e in events if e["ph"] == "X"
            and e["name"] == "weight receive" and e.get("cat") != "gpu" and e["args"]["version"] == STEPS}
    assert last == {"rollout-0": "collective", "rollout-1": "collective"}, last  # the replacement is in the group
    audit = _audit(run_dir)
    assert audit.returncode == 0, audit.stdout + audit.stderr
