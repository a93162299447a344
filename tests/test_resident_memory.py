"""What `check` counts for a sharded fsdp logprob stage, and RLP504's resident trainer.

- an fsdp logprob stage keeps the whole model per rank unless `shard` says
  otherwise; `shard = 0` (all its ranks) or S divides the weights by its
  shard group and adds the gathered layers; an S that does not divide its
  ranks is RLP510; the plan carries the resolved `shard`;
- a train stage that does not offload may share its pipeline's GPUs when
  `gpu_memory` is declared and the estimate (the trainer's peak added to the
  others on every phase) fits; otherwise RLP504 stands.

(tests/test_logprob_memory.py: a logprob stage counts in every phase too.)
"""

from pathlib import Path

import pytest

from rldsl.compiler import memory_model as mm
from rldsl.compiler.driver import compile_source
from rldsl.compiler.memory import stage_estimates

GIB = 2**30
PARAMS = 8e9

PIPELINE = """
pipeline p
cluster { nodes = 1  gpus_per_node = 8  gpu = "H100"  gpu_memory = MEMORY }
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
stage train actor {
  model = policy
  engine = TRAINER
  gpus = 8
  prompts_per_step = 64
  micro_batch = 2
}
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> reference -> actor
staleness { max_lag = 0 }
"""


def compiled(reference: str = "fsdp(dtype = bf16)", trainer: str = "fsdp(dtype = bf16)",
             memory: str = "80GiB"):
    text = PIPELINE.replace("REFERENCE", reference).replace("TRAINER", trainer).replace("MEMORY", memory)
    return compile_source(text, "p.rlp", want_plan=True)


def reference_parts(reference: str) -> dict:
    result = compiled(reference)
    estimate = stage_estimates(result.program, result.placement, Path("."))[("p", "reference")]
    return dict(estimate.parts)


def test_a_logprob_stage_keeps_the_whole_model_unless_it_shards():
    whole = reference_parts("fsdp(dtype = bf16)")
    assert whole["params"] == pytest.approx(PARAMS * 2) and "gathered layers" not in whole
    for engine, ranks in (("fsdp(shard = 0, dtype = bf16)", 8), ("fsdp(shard = 4, dtype = bf16)", 4)):
        sharded = reference_parts(engine)
        shape = mm.nearest_shape(PARAMS)
        assert sharded["params"] == pytest.approx(PARAMS * 2 / ranks), engine
        assert sharded["gathered layers"] == pytest.approx((2 * shape.layer_params + shape.embedding_params) * 2)
        assert sharded["activations"] == whole["activations"]  # the same forward of micro_batch rows per rank


def test_the_plan_carries_the_logprob_stages_shard():
    def shard(reference: str) -> int:
        result = compiled(reference)
        assert result.ok, [d.message for d in result.diagnostics if d.is_error]
        return next(s for s in result.plan.pipelines[0].stages if s.name == "reference").engine.args["shard"]

    assert shard("fsdp(dtype = bf16)") == 1  # each rank a whole copy, serving alone
    assert shard("fsdp(shard = 0, dtype = bf16)") == 0
    assert shard("fsdp(shard = 2, dtype = bf16)") == 2


def test_a_logprob_shard_that_does_not_divide_its_ranks_is_rlp510():
    result = compiled("fsdp(shard = 3, dtype = bf16)")
    (finding,) = [d for d in result.diagnostics if d.code == "RLP510"]
    assert "8 data-parallel ranks" in finding.message and finding.edit[1] == "shard = 2"


def codes(result) -> list[str]:
    return sorted(d.code for d in result.diagnostics if d.is_error)


def test_a_resident_trainer_shares_its_gpus_when_the_estimate_fits():
    result = compiled("fsdp(shard = 0, dtype = bf16)", "fsdp(dtype = bf16, offload = false)")
    assert codes(result) == [], [d.message for d in result.diagnostics if d.is_error]
    gpu = result.memory[0]
    totals = {name.split("/")[1]: detail.total for (name, _), detail in zip(gpu.by_stage, gpu.details)}
    # the trainer counts in every phase, and so does the reference, which scores at any time
    assert gpu.used == pytest.approx(totals["actor"] + totals["reference"] + totals["rollout"])
    offloading = compiled("fsdp(shard = 0, dtype = bf16)").memory[0]
    assert offloading.used < gpu.used


def test_a_resident_trainer_stays_rlp504_where_memory_is_unknown_or_short():
    unknown = PIPELINE.replace("  gpu_memory = MEMORY", "").replace("REFERENCE", "fsdp(dtype = bf16)").replace(
        "TRAINER", "fsdp(dtype = bf16, offload = false)")
    result = compile_source(unknown, "p.rlp")
    findings = [d for d in result.diagnostics if d.code == "RLP504"]  # one per stage it shares GPUs with
    assert len(findings) == 2 and all("`actor` shares GPUs" in d.message for d in findings)
    assert all("`gpu_memory` is declared" in d.help and d.edit[1] == "offload = true" for d in findings)
    short = compiled("fsdp(dtype = bf16)", "fsdp(dtype = bf16, offload = false)", memory="32GiB")
    assert set(codes(short)) == {"RLP504", "RLP506"}
