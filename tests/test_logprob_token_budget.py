"""`micro_batch_tokens` on a logprob stage (NeMo RL's `logprob_mb_tokens`):
the budget's boundaries in the packing shared with the trainers, the
setting from the file to the engine with the row path's logprobs, and what
`check` says about it (RLP108 where the engine schedules its own forwards,
RLP316 below the longest row, the memory estimate's tokens)."""

import copy
from pathlib import Path

import pytest
import torch

from rldsl.compiler.driver import compile_source
from rldsl.runtime.engines.factory import build_logprob
from rldsl.runtime.engines.fsdp import FsdpLogprob
from rldsl.runtime.engines.torch import TorchLogprob
from rldsl.runtime.engines.torch.common import response_logprobs
from rldsl.runtime.engines.torch.packing import forward_rows, real_lengths, token_budget_chunks
from tests.test_split_step_gradient import make_batch, make_model

PIPELINE = Path(__file__).parent.parent / "pipelines" / "grpo_async.rlp"
REFERENCE = "stage logprob reference { model = policy  frozen  colocate = actor }"


def compiled(reference: str, text: str | None = None):
    text = (text or PIPELINE.read_text()).replace(REFERENCE, reference)
    return compile_source(text, str(PIPELINE), base_dir=PIPELINE.parent)


def planned_reference(settings: str):
    result = compiled(f"stage logprob reference {{ model = policy  frozen  colocate = actor  {settings} }}")
    assert result.ok, [d.message for d in result.diagnostics if d.is_error]
    pipe = result.plan.pipelines[0]
    return pipe, next(stage for stage in pipe.stages if stage.name == "reference")


@pytest.mark.parametrize("lengths, budget, chunks", [
    ([5, 5], 10, [[0, 1]]),  # exactly the budget: one forward
    ([5, 6], 10, [[0], [1]]),  # one token over: two
    ([10], 10, [[0]]),
    ([11], 10, [[0]]),  # a row longer than the budget goes alone
    ([11, 1], 10, [[0], [1]]),  # and nothing joins it
    ([1, 1, 1], 1, [[0], [1], [2]]),
])
def test_budget_boundaries(lengths, budget, chunks):
    assert token_budget_chunks(lengths, budget) == chunks


def test_a_logprob_stage_budget_reaches_the_engine_with_the_row_paths_logprobs():
    pipe, stage = planned_reference("micro_batch = 3  micro_batch_tokens = 12")
    assert stage.settings["micro_batch_tokens"] == 12
    budgeted = build_logprob(stage, pipe, seed=0)
    assert isinstance(budgeted, TorchLogprob) and budgeted.tokens_per_forward == 12
    by_rows = build_logprob(planned_reference("micro_batch = 3")[1], pipe, seed=0)
    assert by_rows.tokens_per_forward == 0
    batch = make_batch(budgeted.model)
    forwards = forward_rows(batch, None, 12)
    lengths = real_lengths(batch)
    assert len(forwards) > 1 and any(len(rows) > 1 for rows in forwards)  # the budget really packs and splits
    assert all(len(rows) == 1 or sum(lengths[row] for row in rows) <= 12 for rows in forwards)
    expected, actual = by_rows.logprobs(batch), budgeted.logprobs(batch)
    assert actual.shape == expected.shape and torch.allclose(actual, expected, atol=1e-5)


def test_fsdp_logprob_engine_with_a_budget_matches_the_padded_forward():
    model = make_model()
    batch = make_batch(model)
    with torch.no_grad():
        expected = response_logprobs(model, batch)
    engine = FsdpLogprob(copy.deepcopy(model), tokens_per_forward=12)
    assert torch.allclose(engine.logprobs(batch), expected, atol=1e-5)


def test_the_default_keeps_forwards_by_rows():
    pipe, stage = planned_reference("")
    assert stage.settings.get("micro_batch_tokens", 0) == 0
    assert build_logprob(stage, pipe, seed=0).tokens_per_forward == 0


def _vllm_reference(settings: str) -> str:
    return (f"stage logprob reference {{ model = policy  frozen  engine = vllm(tp = 1)  gpus = 1  {settings} }}")


def test_an_engine_that_schedules_its_own_forwards_refuses_the_budget():
    text = PIPELINE.read_text().replace('source = "builtin:tiny-lm"', 'source = "hf:/models/tiny"  params = 1M')
    text = text.replace("gpus_per_node = 2 ", "gpus_per_node = 3 ")
    result = compiled(_vllm_reference("micro_batch_tokens = 4096"), text)
    found = [d for d in result.diagnostics if d.code == "RLP108"]
    assert len(found) == 1 and "`vllm` schedules its own logprob forwards" in found[0].message
    assert found[0].edit[1] == "0" and "`torch` or `fsdp` or `megatron`" in found[0].help
    assert not [d for d in compiled(_vllm_reference(""), text).diagnostics if d.code == "RLP108"]


def test_a_budget_below_the_longest_row_warns_and_one_above_does_not():
    text = PIPELINE.read_text().replace('eval_size = 128 }', 'eval_size = 128  max_prompt_tokens = 24 }')
    short = compiled(f"{REFERENCE[:-1]} micro_batch_tokens = 16 }}", text)  # rows run to 24 + 8 tokens
    found = [d for d in short.diagnostics if d.code == "RLP316"]
    assert short.ok and len(found) == 1 and "`reference`" in found[0].message and "32 tokens" in found[0].message
    assert found[0].edit[1] == "32"
    assert not [d for d in compiled(f"{REFERENCE[:-1]} micro_batch_tokens = 32 }}", text).diagnostics
                if d.code == "RLP316"]
    # without a prompt bound the longest row is unknown: nothing is said
    assert not [d for d in compiled(f"{REFERENCE[:-1]} micro_batch_tokens = 16 }}").diagnostics
                if d.code == "RLP316"]


def test_the_memory_estimate_counts_the_budget():
    from rldsl.compiler.memory import stage_estimates

    text = PIPELINE.read_text().replace("gpus_per_node = 2 ", "gpus_per_node = 2  gpu_memory = 80GiB ")
    small, large = (compiled(f"{REFERENCE[:-1]} micro_batch_tokens = {tokens} }}", text) for tokens in (64, 4096))
    estimate = {}
    for name, result in (("small", small), ("large", large)):
        assert result.ok, [d.message for d in result.diagnostics if d.is_error]
        estimates = stage_estimates(result.program, result.placement, PIPELINE.parent)
        estimate[name] = estimates[("grpo_async", "reference")]
    assert estimate["small"].total < estimate["large"].total
