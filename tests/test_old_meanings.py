"""Old meanings kept (rldsl.compiler.old_meanings): a file written before a
rule tightened checks with a warning, plans as its current form does, and
`rldsl fmt --fix` writes that form.

- RLP210: a policy logprob stage on its trainer's GPUs without a sync is a
  target of the trainer's sync; the run pushes every version to it.
- RLP509: pipelines on the same GPUs without `share` take turns as if
  declared.
- RLP520: logprob forwards past the GPU are sharded and cut to fit.
- RLP521: a colocated multi-GPU generator replica runs as single-GPU ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.compiler.fmt import format_source
from rldsl.compiler.old_meanings import KEPT_MEANINGS
from tests.runs import rldsl_here
from tests.test_fence import POLICY_LOGPROB

GOLDEN = Path(__file__).parent / "golden"


def codes(text: str) -> list[str]:
    return sorted(d.code for d in compile_source(text).diagnostics)


def formatted(text: str) -> str:
    return format_source(text, compile_source(text).diagnostics)[0]


def assert_same_plan_once_formatted(text: str) -> str:
    new = formatted(text)
    assert not [code for code in codes(new) if code in KEPT_MEANINGS], codes(new)
    assert compile_source(new).plan.pipelines == compile_source(text).plan.pipelines
    return new


# ------------------------------------------------------------------ RLP210

OLD_SCORER = (GOLDEN / "RLP210.rlp").read_text()


def test_a_colocated_policy_scorer_without_a_sync_takes_the_trainers_weights():
    plan = compile_source(OLD_SCORER).plan.pipelines[0]
    assert codes(OLD_SCORER) == ["RLP210"]
    assert plan.weight_receivers() == {"rollout", "behaviour"}
    assert plan.stage("weights").settings["to"] == ["rollout", "behaviour"]
    new = assert_same_plan_once_formatted(OLD_SCORER)
    assert "stage sync weights { from = actor  to = [rollout, behaviour] }" in new


def test_two_colocated_scorers_are_added_in_one_edit():
    text = OLD_SCORER.replace("stage logprob behaviour { model = policy  colocate = actor }",
                              "stage logprob behaviour { model = policy  colocate = actor }\n"
                              "stage logprob proximal { model = policy  colocate = actor }") \
        .replace("score -> behaviour -> actor", "score -> behaviour -> proximal -> actor")
    assert codes(text) == ["RLP210", "RLP210"]
    assert "to = [rollout, behaviour, proximal]" in assert_same_plan_once_formatted(text)


def test_a_scorer_in_the_trainers_placement_group_is_colocated_too():
    groups = "placement { groups = [rollout, [behaviour, actor]]  ratios = [50%, 50%] }"
    text = OLD_SCORER.replace("colocate = actor }", "}").replace("  gpus = 2\n", "") \
        .replace("staleness { max_lag = 1 }", f"staleness {{ max_lag = 1 }}\n{groups}")
    assert codes(text) == ["RLP210"]
    assert_same_plan_once_formatted(text)


def test_a_scorer_on_gpus_of_its_own_still_needs_its_sync():
    text = OLD_SCORER.replace("colocate = actor }", "gpus = 1 }").replace("gpus_per_node = 4", "gpus_per_node = 5")
    assert codes(text) == ["RLP205"]


def test_a_scorer_meant_as_the_missing_reference_is_not_given_weights():
    """kl needs a reference and none is frozen: the scorer is the reference without `frozen` (RLP204 says so)."""
    text = OLD_SCORER.replace("prompts_per_step = 8", "prompts_per_step = 8\n  loss = grpo(kl = 0.01)")
    assert codes(text) == ["RLP204", "RLP205"]


def test_fmt_fix_writes_the_sync_and_says_so(tmp_path):
    path = tmp_path / "old.rlp"
    path.write_text(OLD_SCORER)
    fixed = rldsl_here("fmt", "--fix", str(path))
    assert fixed.returncode == 0 and "(1 old meaning written out)" in fixed.stdout, fixed.stdout + fixed.stderr
    assert "to = [rollout, behaviour]" in path.read_text()
    assert rldsl_here("check", "--strict", str(path)).returncode == 0


# test_fence's pipeline with its scorer left out of the sync, as old files wrote it
SIM_SCORER = POLICY_LOGPROB.replace("to = [rollout, behaviour]", "to = rollout").replace("steps = 8", "steps = 6")
assert SIM_SCORER.count("to = rollout") == 1 and "steps = 6" in SIM_SCORER  # the sync no longer reaches the scorer


@pytest.mark.ray
def test_the_run_pushes_every_version_to_the_colocated_scorer(tmp_path):
    """Without the pushes the scorer keeps version 0 and the trainer's fence drops every later row as
    `stale_logprobs`; with them no row is dropped for a version mismatch."""
    from tests.runs import run_text

    assert codes(SIM_SCORER) == ["RLP210"]
    _, run_dir, summary = run_text(tmp_path, SIM_SCORER, name="old.rlp")
    ledger = summary["ledger"]
    assert summary["steps"] == 6 and ledger["trained"] > 0
    assert "stale_logprobs" not in ledger["dropped"], ledger
    assert rldsl_here("audit", str(run_dir)).returncode == 0


# ------------------------------------------------------------------ RLP509

def test_pipelines_sharing_gpus_without_share_take_turns_as_if_declared():
    text = (GOLDEN / "RLP509.rlp").read_text()
    assert codes(text) == ["RLP509"]
    assert "placement { share = [a] }" in assert_same_plan_once_formatted(text)


def test_the_share_edit_extends_a_share_already_written():
    three = (GOLDEN / "RLP509.rlp").read_text().replace("gpus_per_node = 2", "gpus_per_node = 3") + """
pipeline c {
  model policy { source = "builtin:tiny-lm" }
  dataset prompts { source = "builtin:arith" }
  stage generate rollout { model = policy  gpus = [2]  samples_per_prompt = 4 }
  stage reward score { fn = "rldsl.rewards:exact_match" }
  stage train actor { model = policy  gpus = [0]  prompts_per_step = 8 }
  stage sync weights { from = actor  to = rollout }
  flow prompts -> rollout -> score -> actor
  staleness { max_lag = 1 }
  placement { share = [b] }
}
"""
    assert codes(three).count("RLP509") == 2  # a & b, a & c
    new = formatted(three)
    assert "placement { share = [b, a] }" in new and "RLP509" not in codes(formatted(new))


# ------------------------------------------------------------------ RLP520

OVERFULL = (GOLDEN / "RLP520.rlp").read_text()


def test_logprob_forwards_past_the_gpu_are_sharded_and_cut_to_fit():
    result = compile_source(OVERFULL)
    assert [d.code for d in result.diagnostics] == ["RLP520"]
    behaviour = result.plan.pipelines[0].stage("behaviour")
    assert behaviour.settings["micro_batch"] == 8 and behaviour.engine.args["shard"] == 0
    assert all(gpu.used <= 40 * 2**30 for gpu in result.memory)
    new = assert_same_plan_once_formatted(OVERFULL)
    assert "engine = fsdp(shard = 0, offload = true, dtype = bf16)" in new and "micro_batch = 8\n" in new


def test_a_token_budget_is_never_cut_and_a_gpu_that_cannot_fit_stays_an_error():
    budget = OVERFULL.replace("micro_batch = 16", "micro_batch_tokens = 65536")
    assert "RLP506" in codes(budget) and "RLP520" not in codes(budget)
    small = OVERFULL.replace("gpu_memory = 40GiB", "gpu_memory = 24GiB")
    assert "RLP506" in codes(small) and "RLP520" not in codes(small)


# ------------------------------------------------------------------ RLP521

SPLIT = (GOLDEN / "RLP521.rlp").read_text()


def test_a_colocated_multi_gpu_replica_runs_as_single_gpu_replicas():
    rollout = compile_source(SPLIT).plan.pipelines[0].stage("rollout")
    assert codes(SPLIT) == ["RLP521"] and rollout.tp == 1 and len(rollout.ranks) == 4
    assert "engine = sglang(tp = 1, gpu_memory = 40%)" in assert_same_plan_once_formatted(SPLIT)


def test_a_colocated_multi_gpu_vllm_replica_runs_as_written():
    """vLLM's replicas leave shared GPUs to their engine's Ray workers (rldsl.layout): no old meaning to keep."""
    text = SPLIT.replace("sglang(tp = 2", "vllm(tp = 2")
    rollout = compile_source(text).plan.pipelines[0].stage("rollout")
    assert codes(text) == [] and rollout.tp == 2 and len(rollout.ranks) == 2


def test_a_model_one_gpu_cannot_hold_keeps_the_layout_error():
    assert codes(SPLIT.replace("gpu_memory = 40%", "gpu_memory = 5%")) == ["RLP512"]  # 1 GB of weights in 1.2
    assert codes(SPLIT.replace("  gpu_memory = 24GiB", "")) == ["RLP512"]
