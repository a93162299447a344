"""Defaults that hold on GPUs (rldsl.compiler.gpu_defaults): a plan whose
file says it runs on real GPUs checkpoints every 10 steps (the newest 3
kept) and evaluates on the generators within 10 minutes unless the file
says otherwise; CPU plans keep the plain defaults. The watchdog's stall
time scales with `max_new_tokens` and the measured decode rate
(rldsl.runtime.control.decode_rate)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from rldsl.compiler.driver import compile_file, compile_source
from rldsl.runtime.control.decode_rate import DecodeRate, longest_response, stall_timeout
from rldsl.runtime.control.errors import PipelineStalled
from rldsl.runtime.control.settings import settings_from_plan
from rldsl.runtime.control.watchdog import Watchdog

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = sorted((ROOT / "pipelines").glob("*.rlp"))
CPU_FILES = [p for p in PIPELINES if not any(word in p.read_text() for word in ("vllm", "sglang", "megatron",
                                                                                 "gpu_memory", "gpu = "))]


def plan_of(text: str):
    result = compile_source(text, "p.rlp")
    assert result.plan is not None, [d.message for d in result.diagnostics if d.is_error]
    return result.plan.pipelines[0]


@pytest.mark.parametrize("path", CPU_FILES, ids=lambda p: p.name)
def test_cpu_plans_keep_the_plain_defaults(path):
    for pipe in compile_file(path).plan.pipelines:
        text = path.read_text()
        assert pipe.run.eval_timeout_s == 0.0 and pipe.eval_on == "evaluator"
        if "checkpoint_every" not in text:
            assert pipe.run.checkpoint_every == 0 and pipe.run.keep_checkpoints == 0


def test_a_gpu_plan_checkpoints_every_10_steps_and_evaluates_on_the_generators():
    pipe = plan_of((ROOT / "pipelines" / "partial_overlap.rlp").read_text())  # vllm + megatron, no run keys
    assert (pipe.run.checkpoint_every, pipe.run.keep_checkpoints) == (10, 3)
    assert pipe.eval_on == "generators" and pipe.run.eval_timeout_s == 600.0


def test_what_a_gpu_file_writes_wins():
    text = (ROOT / "pipelines" / "gpu_cluster.rlp").read_text()
    pipe = plan_of(text)
    assert (pipe.run.checkpoint_every, pipe.run.keep_checkpoints) == (50, 0)  # written: nothing it saved is deleted
    written = text.replace("run {", "run {\n  eval_timeout = 30s  keep_checkpoints = 5").replace(
        "dataset prompts {", "dataset prompts {\n  eval_on = evaluator")
    pipe = plan_of(written)
    assert pipe.run.eval_timeout_s == 30.0 and pipe.run.keep_checkpoints == 5 and pipe.eval_on == "evaluator"


def test_a_declared_gpu_makes_a_torch_plan_a_gpu_plan_but_sim_generators_never_evaluate_there():
    base = (ROOT / "tests" / "golden" / "base.rlp").read_text()
    torch_gpu = plan_of(base.replace("gpus_per_node = 4", 'gpus_per_node = 4  gpu = "H100"'))
    assert torch_gpu.eval_on == "generators" and torch_gpu.run.checkpoint_every == 10
    sim = base.replace("  samples_per_prompt = 4", "  engine = sim\n  samples_per_prompt = 4")
    assert plan_of(sim.replace("gpus_per_node = 4", 'gpus_per_node = 4  gpu = "H100"')).eval_on == "evaluator"


# ------------------------------------------------------------------ the watchdog

def test_the_stall_time_is_the_watchdog_or_three_responses_at_the_measured_rate():
    assert stall_timeout(120.0, 16, None) == 120.0  # nothing measured yet
    assert stall_timeout(120.0, 16, 300.0) == 120.0  # CPU answers: the watchdog holds
    assert stall_timeout(120.0, 8192, 20.0) == pytest.approx(3 * 8192 / 20.0)
    rate = DecodeRate()
    for tokens, seconds in [(100, 10.0), (100, 1000.0), (100, 10.0)]:  # one call waited on a sleeping replica
        rate.record(tokens, seconds)
    assert rate.tokens_per_s() == 10.0
    assert longest_response(12, (3, 9), 2) == 9 and longest_response(12, (), 2) == 6


def watchdog(max_new_tokens: int, rate: float | None, idle_s: float) -> Watchdog:
    decode_rate = DecodeRate()
    if rate:
        decode_rate.record(int(rate), 1.0)
    state = SimpleNamespace(settings=SimpleNamespace(watchdog_timeout_s=120.0, max_new_tokens=max_new_tokens),
                            decode_rate=decode_rate, clock=lambda: 1000.0, last_progress=1000.0 - idle_s)
    return Watchdog(state, lambda: "waiting on generate")


def test_long_responses_at_a_slow_rate_are_not_a_stall_but_a_longer_silence_is():
    asyncio.run(watchdog(8192, 20.0, idle_s=600.0).check())  # 600 s < 1229 s: a group still decoding
    with pytest.raises(PipelineStalled, match=r"watchdog 1229s: 3 x 8192-token responses at the measured 20\.0"):
        asyncio.run(watchdog(8192, 20.0, idle_s=1300.0).check())
    with pytest.raises(PipelineStalled, match=r"\(watchdog 120s\)"):
        asyncio.run(watchdog(16, 300.0, idle_s=121.0).check())


def test_the_controller_reads_the_longest_response_from_the_plan():
    settings = settings_from_plan(compile_file(ROOT / "pipelines" / "grpo_async.rlp").plan.pipelines[0])
    assert settings.max_new_tokens == 8
    multiturn = settings_from_plan(compile_file(ROOT / "pipelines" / "multiturn_arith.rlp").plan.pipelines[0])
    assert multiturn.max_new_tokens >= 8
