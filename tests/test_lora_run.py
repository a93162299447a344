"""`rldsl run pipelines/grpo_lora.rlp` on Ray: the trainer trains only its
LoRA adapters, every push carries only them and the generator serves them
(its samples' logprobs equal the trainer's on the same weights), the
checkpoint holds only them, and `rldsl export` merges them into the model."""

import json

import pytest
import torch

from tests.runs import rldsl_here

pytestmark = [pytest.mark.ray]

ADAPTER_BYTES = 24576  # rank 8 on qkv and out of builtin:tiny-lm's 2 blocks, fp32 (tests/test_lora.py)


def test_a_lora_run_pushes_only_its_adapters_and_the_generator_serves_them(tmp_path):
    run_dir = tmp_path / "run"
    run = rldsl_here("run", "pipelines/grpo_lora.rlp", "--run-dir", str(run_dir), "--set", "run.steps=3",
                     "--set", "run.eval_every=0", "--set", "prompts.eval_size=16")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == summary["version"] == 3 and summary["weight_pushes"] >= 2
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trainer = [s["trainer"] for s in steps if "lag_histogram" in s]
    assert len(trainer) == 3 and all(t["push_bytes"] == ADAPTER_BYTES for t in trainer)
    assert run.stderr.count("push 24.0KiB") >= 3  # on every step line
    # rows sampled on the trainer's own version: the generator's logprobs are the trainer's, so every
    # pushed adapter reached it (a push that missed it would leave these far apart)
    same = [(t["mismatch/tokens"], t["mismatch/abs_diff_max"]) for t in trainer if t.get("mismatch/tokens")]
    assert same and all(largest < 1e-4 for _, largest in same), same
    checkpoint = max((run_dir / "checkpoints").glob("v*")) / "trainer" / "torch.pt"
    saved = torch.load(checkpoint, weights_only=False)["model"]
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved)
    assert sum(t.numel() * t.element_size() for t in saved.values()) == ADAPTER_BYTES
    assert rldsl_here("export", str(run_dir), "--out", str(tmp_path / "hf")).returncode == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
