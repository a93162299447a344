"""`top_k`, `stop_token_ids` and `min_new_tokens` on a generate stage: the
torch engine draws only among the k most likely tokens, ends a row on a stop
token and not before the fewest tokens; vLLM and SGLang get them in their own
sampling parameters; the plan carries them."""

from __future__ import annotations

from pathlib import Path

import torch

from rldsl.compiler.driver import compile_source
from rldsl.models.tiny import build_tiny_lm
from rldsl.runtime.engines.factory import sampling_settings
from rldsl.runtime.engines.sglang import sampling_params
from rldsl.runtime.engines.torch import TorchGenerator
from rldsl.runtime.engines.torch.generate import _top_k_filter
from rldsl.runtime.engines.vllm import sampling_options
from rldsl.runtime.protocols import Prompt

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [Prompt(0, "12+7=", "19"), Prompt(1, "3+45=", "48")]


def small_model(seed=0):
    return build_tiny_lm(seed, d_model=32, n_layers=2, n_heads=2, d_ff=64)


def test_top_k_keeps_the_k_most_likely_tokens():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.4, 0.1]])
    assert torch.equal(_top_k_filter(probs, 2), torch.tensor([[0.0, 0.4, 0.0, 0.3], [0.25, 0.25, 0.4, 0.0]]))
    assert torch.equal(_top_k_filter(probs, 4), probs)


def test_top_1_sampling_is_greedy():
    model = small_model()
    greedy = TorchGenerator(model, max_new_tokens=5).generate_greedy(PROMPTS)
    top_1 = TorchGenerator(model, max_new_tokens=5, temperature=1.5, top_k=1)
    assert top_1.decode(top_1.generate(PROMPTS, 3, seed=4)) == [text for text in greedy for _ in range(3)]


def test_a_stop_token_ends_the_row_and_is_kept_like_eos():
    model = small_model(seed=3)
    free = TorchGenerator(model, max_new_tokens=12, temperature=1.0).generate(PROMPTS, 4, seed=7)
    lengths = free["response_mask"].sum(dim=1)
    row = int(lengths.argmax())
    stop = int(free["response_ids"][row, 1])  # the second token a long row drew
    stopped = TorchGenerator(model, max_new_tokens=12, temperature=1.0, stop_token_ids=(stop,))
    batch = stopped.generate(PROMPTS, 4, seed=7)
    for ids, mask in zip(batch["response_ids"], batch["response_mask"]):
        real = ids[: int(mask.sum())].tolist()
        assert stop not in real[:-1]  # the stop token only as the last real token
    assert batch["response_mask"][row].sum() == 2 and batch["response_ids"][row, 1] == stop



def test_greedy_evaluation_stops_on_the_stop_tokens_too():
    model = small_model(seed=3)
    unstopped = TorchGenerator(model, max_new_tokens=12).generate_greedy(PROMPTS)
    stop_char = unstopped[0][1]  # the second character greedy decoding writes for the first prompt
    (stop,) = model.tokenizer.encode(stop_char, add_bos=False, add_eos=False)
    stopped = TorchGenerator(model, max_new_tokens=12, stop_token_ids=(stop,)).generate_greedy(PROMPTS)
    for free_text, text in zip(unstopped, stopped):
        assert text == (free_text[:free_text.index(stop_char) + 1] if stop_char in free_text else free_text)
    assert len(stopped[0]) < len(unstopped[0])  # it did stop early


def test_no_response_ends_before_min_new_tokens_and_its_logprobs_are_those_it_was_drawn_from():
    from rldsl.runtime.engines.torch.common import encode_prompts, positions_from_mask

    model = small_model()
    forward = model.forward

    def eos_prone(*args, **kwargs):  # an untrained model almost never ends: make EOS likely
        logits, cache = forward(*args, **kwargs)
        return logits.index_add(-1, torch.tensor([model.eos_id]), torch.full((*logits.shape[:-1], 1), 4.0)), cache

    model.forward = eos_prone
    free = TorchGenerator(model, max_new_tokens=12, temperature=1.5).generate(PROMPTS, 8, seed=1)
    assert free["response_mask"].sum(dim=1).min() < 6  # without the floor, some end early
    held = TorchGenerator(model, max_new_tokens=12, temperature=1.5, min_new_tokens=6).generate(PROMPTS, 8, seed=1)
    assert held["response_mask"].sum(dim=1).min() >= 6
    assert not torch.isin(held["response_ids"][:, :5], torch.tensor([model.eos_id])).any()
    # the logprobs are the model's own, as the trainer computes them (not renormalised without EOS)
    ids, mask = encode_prompts(model.tokenizer, PROMPTS, model.device)
    logits, _ = model.forward(ids, mask, positions_from_mask(mask))
    expected = torch.log_softmax(logits[:, -1].float() / 1.5, dim=-1).repeat_interleave(8, dim=0)
    expected = expected.gather(1, held["response_ids"][:, :1]).squeeze(1)
    assert torch.allclose(held["behaviour_logprobs"][:, 0], expected, atol=1e-5)
    # evaluation is not held back
    assert TorchGenerator(model, max_new_tokens=12, min_new_tokens=12).generate_greedy(PROMPTS) == \
        TorchGenerator(model, max_new_tokens=12).generate_greedy(PROMPTS)


def test_min_new_tokens_above_max_new_tokens_is_refused():
    import pytest

    with pytest.raises(ValueError, match="min_new_tokens"):
        TorchGenerator(small_model(), max_new_tokens=4, min_new_tokens=5)
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text().replace(
        "  max_new_tokens = 8\n", "  max_new_tokens = 8\n  min_new_tokens = 9\n", 1)
    (found,) = compile_source(text, "x.rlp").diagnostics
    assert found.code == "RLP106" and "more than max_new_tokens = 8" in found.message


def test_the_serving_engines_receive_them():
    options = sampling_options(4, 64, 1.0, 0.9, 7, top_k=100, stop_token_ids=(128009,))
    assert options["top_k"] == 100 and options["stop_token_ids"] == [128009]
    assert sampling_options(4, 64, 1.0, 0.9, 7)["top_k"] == -1  # vLLM's "every token"
    params = sampling_params(64, 1.0, 0.9, 7, top_k=100, stop_token_ids=(128009,))
    assert params["top_k"] == 100 and params["stop_token_ids"] == [128009]
    assert sampling_params(64, 1.0, 0.9, 7)["top_k"] == -1 and "stop_token_ids" not in sampling_params(64, 1.0, 0.9, 7)
    assert sampling_options(4, 64, 1.0, 0.9, 7, min_new_tokens=16)["min_tokens"] == 16  # vLLM's name
    assert sampling_params(64, 1.0, 0.9, 7, min_new_tokens=16)["min_new_tokens"] == 16  # SGLang's


def test_the_plan_carries_them_and_old_plans_sample_as_before():
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text().replace(
        "  temperature = 1.0\n", "  temperature = 1.0\n  top_k = 20\n  stop_token_ids = [5, 6]\n", 1)
    result = compile_source(text, "x.rlp")
    assert result.ok, result.diagnostics
    rollout = result.plan.pipelines[0].stage("rollout")
    assert sampling_settings(rollout)["top_k"] == 20 and sampling_settings(rollout)["stop_token_ids"] == (5, 6)
    del rollout.settings["top_k"], rollout.settings["stop_token_ids"]  # a plan.json written before the keys
    assert sampling_settings(rollout)["top_k"] == 0 and sampling_settings(rollout)["stop_token_ids"] == ()
    del rollout.settings["min_new_tokens"]
    assert sampling_settings(rollout)["min_new_tokens"] == 0


def test_truncated_mask_leaves_out_only_responses_cut_before_they_ended():
    from rldsl.runtime.protocols import FIELD_LOSS_MASK, mask_truncated, trained_tokens

    eos, stop = 2, 9
    batch = {"response_ids": torch.tensor([[5, 6, 2], [5, 6, 7], [5, 0, 0], [4, 4, 9]]),
             "response_mask": torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 1]])}
    assert mask_truncated(batch, 3, (eos, stop)) == 1  # row 1 ran to 3 tokens without ending
    assert batch[FIELD_LOSS_MASK].tolist() == [[1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 1]]
    assert trained_tokens(batch).sum(dim=1).tolist() == [3, 0, 1, 3]


def test_truncated_mask_sends_a_loss_mask_to_the_trainer():
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text()
    masked = compile_source(text.replace("  temperature = 1.0\n", "  temperature = 1.0\n  truncated = mask\n", 1),
                            "x.rlp")
    assert masked.ok, masked.diagnostics
    fields = {f for e in masked.plan.pipelines[0].edges if e.kind == "data" for f in e.fields}
    assert "loss_mask" in fields
    plain = compile_source(text, "x.rlp").plan.pipelines[0]
    assert "loss_mask" not in {f for e in plain.edges if e.kind == "data" for f in e.fields}


def test_logprobs_are_taken_at_the_sampling_temperature_by_generator_trainer_and_logprob_stage():
    """At temperature 0.7 the behaviour logprobs are log softmax(logits / 0.7)
    of the drawn tokens, and the trainer and a logprob stage told the same
    temperature compute exactly those: the PPO ratio is 1 for unchanged
    weights (at temperature 1 it would not be)."""
    from rldsl.runtime.engines.torch.common import response_logprobs
    from rldsl.runtime.engines.torch.logprob import TorchLogprob
    from rldsl.runtime.engines.torch.train import TorchTrainer

    model = small_model()
    batch = TorchGenerator(model, max_new_tokens=6, temperature=0.7).generate(PROMPTS, 4, seed=3)
    behaviour, mask = batch["behaviour_logprobs"], batch["response_mask"].bool()
    with torch.no_grad():
        at_one = response_logprobs(model, batch)
        trainer = TorchTrainer(model, offload=False, temperature=0.7)._logprobs(batch)[1]
    scored = TorchLogprob(model, temperature=0.7).logprobs(batch)
    assert torch.allclose(trainer[mask], behaviour[mask], atol=1e-6)
    assert torch.allclose(scored[mask], behaviour[mask], atol=1e-6)
    assert float((at_one[mask] - behaviour[mask]).abs().max()) > 1e-2  # temperature 1 is another policy


def test_the_trainer_and_logprob_stages_are_told_the_generators_temperature():
    from rldsl.compiler.overrides import apply_overrides
    from rldsl.runtime.engines.factory import sampling_temperature, training_options

    text = apply_overrides((ROOT / "pipelines" / "grpo_async.rlp").read_text(), ["rollout.temperature=0.7"])
    pipe = compile_source(text, "t.rlp").plan.pipelines[0]
    assert sampling_temperature(pipe) == 0.7 == training_options(pipe.stage("actor"), pipe)["temperature"]
