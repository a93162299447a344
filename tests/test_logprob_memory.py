"""What `check` counts for a logprob stage on shared GPUs, and for its logits.

- a logprob stage scores each group as it arrives, beside generation and
  training: its peak (weights while scoring + one forward) adds to every
  phase of the other stages on its GPUs, whether it offloads or not;
- the torch and fsdp engines log-softmax a slice of positions at a time, so
  a forward holds the logits in the compute dtype plus one fp32 slice;
  megatron log-softmaxes them whole in fp32.
"""

from pathlib import Path

import pytest

from rldsl.compiler import memory_model as mm
from rldsl.compiler.driver import compile_file, compile_source
from rldsl.compiler.memory import stage_estimates

GIB = 2**30
ROOT = Path(__file__).resolve().parent.parent

PIPELINE = """
pipeline p
cluster { nodes = 1  gpus_per_node = 8  gpu = "H100"  gpu_memory = 80GiB }
model policy { source = "hf:/models/policy"  params = 8B  dtype = bf16 }
dataset prompts { source = "builtin:arith" }
stage generate rollout {
  model = policy
  engine = vllm(tp = 1, gpu_memory = 40%, max_model_len = 2048)
  colocate = actor
  samples_per_prompt = 8
  max_new_tokens = 1024
}
stage reward score { fn = "rldsl.rewards:exact_match" }
stage logprob reference { model = policy  frozen  engine = REFERENCE  colocate = actor  micro_batch = 2 }
stage train actor { model = policy  engine = fsdp(dtype = bf16)  gpus = 8  prompts_per_step = 64  micro_batch = 2 }
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> reference -> actor
staleness { max_lag = 0 }
"""


def gpu_zero(reference: str):
    result = compile_source(PIPELINE.replace("REFERENCE", reference), "p.rlp")
    gpu = result.memory[0]
    return result, gpu, {name.split("/")[1]: detail for (name, _), detail in zip(gpu.by_stage, gpu.details)}


@pytest.mark.parametrize("reference", ["fsdp(shard = 0, offload = true, dtype = bf16)",
                                       "fsdp(shard = 0, offload = false, dtype = bf16)",
                                       "torch(offload = true, dtype = bf16)"])
def test_a_logprob_stage_counts_beside_every_phase_of_the_others(reference):
    _, gpu, stages = gpu_zero(reference)
    scorer = stages["reference"]
    assert scorer.concurrent and not scorer.takes_turns and scorer.asleep == scorer.total
    assert stages["actor"].takes_turns and stages["rollout"].takes_turns
    # the trainer and the generator take turns (the larger counts); the reference adds to either
    assert gpu.used == pytest.approx(scorer.total + max(stages["actor"].total, stages["rollout"].total))
    assert gpu.used > max(stages["actor"].total, stages["rollout"].total)  # the old count left it out


def test_rlp506_says_the_logprob_stage_scores_beside_the_others():
    # 32 rows of 2048 tokens as a token budget (rows alone would be cut to fit: RLP520): a 43 GiB forward
    # beside the 32 GiB generator; each alone would fit
    reference = "fsdp(offload = true, dtype = bf16)  colocate = actor  micro_batch_tokens = 65536 }"
    text = PIPELINE.replace("REFERENCE  colocate = actor  micro_batch = 2 }", reference).replace(
        "gpu_memory = 80GiB", "gpu_memory = 70GiB")
    result = compile_source(text, "p.rlp")
    (error,) = [d for d in result.diagnostics if d.code == "RLP506"]
    assert any(note.startswith("reference (forward): params") for note in error.notes)
    assert error.notes[-1].startswith("a logprob stage scores while the others run")


def test_a_vllm_logprob_stage_keeps_its_share_beside_the_others():
    text = PIPELINE.replace("REFERENCE", "vllm(gpu_memory = 20%, max_model_len = 2048)").replace(
        "gpu_memory = 40%", "gpu_memory = 30%")
    result = compile_source(text, "p.rlp")
    gpu = result.memory[0]
    reference = next(d for (name, _), d in zip(gpu.by_stage, gpu.details) if name == "p/reference")
    assert reference.concurrent and reference.total == pytest.approx(0.2 * 80 * GIB)
    assert gpu.used == pytest.approx(reference.total + max(d.total for d in gpu.details if not d.concurrent))


def test_a_sliced_forward_holds_the_logits_in_the_compute_dtype_and_one_fp32_slice():
    shape, tokens = mm.REFERENCE_SHAPES[8.03e9], 32768
    layer = tokens * shape.activation_width * 2
    sliced = mm.forward_bytes(shape, tokens, 2, sliced=True)
    assert sliced == layer + tokens * shape.vocab * 2 + 2 * mm.LOGPROB_SLICE_TOKENS * shape.vocab * 4
    assert mm.forward_bytes(shape, tokens, 2) == layer + tokens * shape.vocab * 4  # megatron: all in fp32
    short = mm.forward_bytes(shape, 100, 2, sliced=True)  # a forward shorter than a slice upcasts only itself
    assert short == 100 * shape.activation_width * 2 + 100 * shape.vocab * 2 + 2 * 100 * shape.vocab * 4
    fp32 = mm.forward_bytes(shape, tokens, 4, sliced=True)  # fp32 logits: no upcast, the slice's log-softmax only
    assert fp32 == tokens * shape.activation_width * 4 + tokens * shape.vocab * 4 \
        + mm.LOGPROB_SLICE_TOKENS * shape.vocab * 4


def test_the_engines_choose_sliced_or_whole_logits():
    text = PIPELINE.replace("gpu_memory = 80GiB", "gpu_memory = 800GiB")
    def activations(reference: str) -> float:
        result = compile_source(text.replace("REFERENCE", reference), "p.rlp")
        return dict(stage_estimates(result.program, result.placement, Path("."))[("p", "reference")].parts)[
            "activations"]

    shape, tokens = mm.REFERENCE_SHAPES[8.03e9], 2 * 2048
    assert activations("fsdp(dtype = bf16)") == pytest.approx(mm.forward_bytes(shape, tokens, 2, sliced=True))
    assert activations("torch(dtype = bf16)") == activations("fsdp(shard = 0, dtype = bf16)") \
        == activations("fsdp(dtype = bf16)")
    assert activations("megatron(dtype = bf16)") == pytest.approx(mm.forward_bytes(shape, tokens, 2))


def test_the_slice_is_the_runtimes():
    from rldsl.runtime.engines.torch.common import LOGPROB_SLICE_TOKENS

    assert mm.LOGPROB_SLICE_TOKENS == LOGPROB_SLICE_TOKENS


def test_the_verl_translation_counts_the_reference_beside_the_resident_actor():
    result = compile_file(ROOT / "pipelines" / "from_verl_grpo_gsm8k.rlp")
    gpu = result.memory[2]
    stages = {name.split("/")[1]: detail for (name, _), detail in zip(gpu.by_stage, gpu.details)}
    assert not stages["actor"].sleeps and stages["reference"].concurrent
    assert gpu.used == pytest.approx(stages["actor"].total + stages["reference"].total)
    assert 70 * GIB < gpu.used < 80 * GIB
