"""`rldsl run` of pipelines/lora_many.rlp's pipelines on Ray: LoRA pipelines
on one base, one generator actor serving them all, each pipeline's samples
drawn with its own adapters at its own version; every push and checkpoint
only the adapters, and `rldsl export` merges them; a frozen reference scored
by its trainer's ranks with the adapters off (that trainer on a GPU of its
own: a reference takes no lease). Two of its three pipelines show it (`rldsl
check` and the plan of all three: tests/test_served_generator.py)."""

import json
from pathlib import Path

import pytest
import torch

from tests.runs import rldsl_here

pytestmark = [pytest.mark.ray]
TEXT = (Path(__file__).parent.parent / "pipelines" / "lora_many.rlp").read_text()
PIPELINES = ("exact", "chars")
ADAPTER_BYTES = 24576  # rank 8 on qkv and out of builtin:tiny-lm's 2 blocks, fp32 (tests/test_lora.py)


def test_one_generator_serves_two_pipelines_each_with_its_own_adapters(tmp_path):
    text = TEXT[:TEXT.index("pipeline rloo")].replace("share = [exact, rloo]", "share = [exact]")
    exact = text[text.index("pipeline exact"):text.index("pipeline chars")]  # with a KL to a frozen reference
    text = text.replace(exact, exact.replace("lr = 5e-3 }", "lr = 5e-3  loss = grpo(kl = 0.1) }\n"
                                             "  stage logprob reference { model = policy  frozen  colocate = actor }")
                        .replace("-> score -> actor", "-> score -> reference -> actor").replace("gpus = [1]", "gpus = [2]"))
    text = text.replace("gpus_per_node = 2 ", "gpus_per_node = 3 ")
    (tmp_path / "two.rlp").write_text(text)
    run_dir = tmp_path / "run"
    on_policy = [arg for name in PIPELINES for arg in (
        "--set", f"{name}.staleness.max_lag=0", "--set", f"{name}.run.eval_at_start=false",
        "--set", f"{name}.prompts.eval_size=16")]
    # `chars` evaluates at its end on the generator it is served by, with its own adapters; `exact` does not
    on_policy += ["--set", "chars.prompts.eval_on=generators", "--set", "exact.run.eval_at_end=false"]
    run = rldsl_here("run", str(tmp_path / "two.rlp"), "--run-dir", str(run_dir), "--steps", "3", *on_policy)
    assert run.returncode == 0, run.stderr[-3000:]
    placement = json.dumps(json.loads((run_dir / "placement.json").read_text()))
    assert sorted(a for a in placement.split('"') if "rollout-" in a) == ["exact/rollout-0"]
    assert "reference" not in placement  # scored on the trainer's ranks: no actor of its own
    adapters = {}
    for name in PIPELINES:
        summary = json.loads((run_dir / name / "summary.json").read_text())
        assert summary["steps"] == summary["version"] == 3, summary
        steps = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
        trainer = [s["trainer"] for s in steps if "lag_histogram" in s]
        # on-policy: every row was sampled with the trainer's own current adapters, so the generator's
        # logprobs are the trainer's; another pipeline's adapters (or a missed push) would set them apart
        assert len(trainer) == 3 and all(t["mismatch/tokens"] == t["tokens"] for t in trainer), trainer
        assert all(t["mismatch/abs_diff_max"] < 1e-4 for t in trainer), [t["mismatch/abs_diff_max"] for t in trainer]
        assert all(t["push_bytes"] == ADAPTER_BYTES for t in trainer) and summary["weight_pushes"] >= 2
        checkpoint = max((run_dir / name / "checkpoints").glob("v*")) / "trainer" / "torch.pt"
        adapters[name] = torch.load(checkpoint, weights_only=False)["model"]
        assert adapters[name] and all(".lora_A." in key or ".lora_B." in key for key in adapters[name])
        assert sum(t.numel() * t.element_size() for t in adapters[name].values()) == ADAPTER_BYTES
        if name == "exact":  # the reference is the base: the fresh adapters equal it, trained ones do not
            assert trainer[0]["kl"] == 0.0 and trainer[-1]["kl"] > 0.0, [t["kl"] for t in trainer]
        else:  # evaluated by its side of the shared generator, on its own newest adapters
            evals = [s for s in steps if s.get("eval")]
            assert [(e["on"], e["version"]) for e in evals] == [("generators", 3)], evals
    assert run.stderr.count("push 24.0KiB") >= 6  # on every step line
    # the pipelines learnt different adapters, which the one generator served side by side
    assert any(not torch.equal(adapters["exact"][k], adapters["chars"][k]) for k in adapters["exact"])
    assert rldsl_here("export", str(run_dir), "--pipeline", "chars", "--out", str(tmp_path / "hf")).returncode == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
