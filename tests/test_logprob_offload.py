"""Logprob engines that offload, the torch trainer's sleep, and sliced log-softmax.

- ``token_logprobs`` log-softmaxes a slice of positions at a time and gives
  exactly the values (and gradients) of the whole log-softmax;
- a logprob stage with `offload = true` that shares its GPUs keeps its
  weights in host memory between scoring calls (factory:
  ``offloads_between_calls``); on a GPU the weights come back for a call and
  leave after it, pushes land in the host copy, and the logprobs are those
  of an engine that never offloads;
- the torch trainer's ``sleep`` refuses steps until ``wake`` and, on a GPU,
  moves weights and AdamW state to host memory and back bit for bit.
"""

from dataclasses import replace

import pytest
import torch

from rldsl.compiler.driver import compile_source
from rldsl.models.tiny import build_tiny_lm
from rldsl.runtime.engines.factory import build_logprob, offloads_between_calls
from rldsl.runtime.engines.torch import TorchGenerator, TorchLogprob, TorchTrainer
from rldsl.runtime.engines.torch.common import token_logprobs
from rldsl.runtime.protocols import Prompt

PROMPTS = [Prompt(0, "12+7=", "19"), Prompt(1, "3+45=", "48"), Prompt(2, "reverse abc:", "cba")]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def small_model(seed=0):
    return build_tiny_lm(seed, d_model=32, n_layers=2, n_heads=2, d_ff=64)


def whole_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slice_tokens", [1, 3, 7, 1024])
def test_sliced_log_softmax_equals_the_whole_one(dtype, slice_tokens):
    generator = torch.Generator().manual_seed(0)
    padded = (torch.randn(3, 7, 50, generator=generator) * 4).to(dtype)
    padded_targets = torch.randint(0, 50, (3, 7), generator=generator)
    assert torch.equal(token_logprobs(padded, padded_targets, slice_tokens), whole_logprobs(padded, padded_targets))
    packed, packed_targets = padded[0], padded_targets[0]  # one packed row: [positions, vocab]
    assert torch.equal(token_logprobs(packed, packed_targets, slice_tokens), whole_logprobs(packed, packed_targets))
    view = padded[:, 2:-1]  # a strided view, as the forward's response positions are
    assert torch.equal(token_logprobs(view, padded_targets[:, 2:-1], slice_tokens),
                       whole_logprobs(view, padded_targets[:, 2:-1]))


def test_sliced_log_softmax_has_the_whole_ones_gradient():
    logits = torch.randn(2, 9, 30, generator=torch.Generator().manual_seed(1), requires_grad=True)
    targets = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(2))
    (sliced,) = torch.autograd.grad(token_logprobs(logits, targets, 4).sum(), logits)
    (whole,) = torch.autograd.grad(whole_logprobs(logits, targets).sum(), logits)
    assert torch.equal(sliced, whole)


def test_sliced_log_softmax_of_nothing_is_empty():
    assert token_logprobs(torch.zeros(0, 5, 10), torch.zeros(0, 5, dtype=torch.long)).shape == (0, 5)
    assert token_logprobs(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long)).shape == (0,)


PIPELINE = """
pipeline p
cluster { nodes = 1  gpus_per_node = 3 }
model policy { source = "builtin:tiny-lm" }
dataset prompts { source = "jsonl:prompts.jsonl" }
stage generate rollout { model = policy  engine = torch  gpus = [0]  samples_per_prompt = 2  max_new_tokens = 4 }
stage reward score { fn = "rldsl.rewards:exact_match" }
stage logprob reference { model = policy  frozen  engine = REFERENCE  PLACED  micro_batch = 2 }
stage train actor { model = policy  engine = torch  gpus = [1]  prompts_per_step = 4 }
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> reference -> actor
staleness { max_lag = 1 }
"""


def reference_plan(engine: str, placed: str):
    result = compile_source(PIPELINE.replace("REFERENCE", engine).replace("PLACED", placed), "p.rlp",
                            want_plan=True)
    assert result.plan is not None, [d.message for d in result.diagnostics if d.is_error]
    pipe = result.plan.pipelines[0]
    return pipe, pipe.stage("reference")


def test_a_logprob_stage_offloads_between_calls_only_where_it_shares_gpus():
    pipe, shared = reference_plan("torch(offload = true)", "colocate = actor")
    assert offloads_between_calls(shared) and build_logprob(shared, pipe, seed=0).offload
    resident = replace(shared, engine=replace(shared.engine, args={**shared.engine.args, "offload": False}))
    assert not offloads_between_calls(resident)  # (check refuses it colocated: RLP504)
    assert not offloads_between_calls(reference_plan("torch(offload = true)", "gpus = [2]")[1])  # alone on GPU 2
    pipe, fsdp = reference_plan("fsdp(offload = true)", "colocate = actor")
    assert build_logprob(fsdp, pipe, seed=0).offload


def scored_batch():
    return TorchGenerator(small_model(seed=3), max_new_tokens=5).generate(PROMPTS, 2, seed=4)


def test_an_offloading_logprob_engine_scores_as_one_that_does_not():
    batch = scored_batch()
    offloading, resident = TorchLogprob(small_model(), offload=True), TorchLogprob(small_model())
    assert torch.equal(offloading.logprobs(batch), resident.logprobs(batch))


def test_the_torch_trainer_refuses_steps_while_asleep():
    trainer = TorchTrainer(small_model())
    trainer.sleep()
    assert trainer.asleep
    for call in (lambda: trainer.begin_train_step(0), lambda: trainer.weight_buckets(1 << 20)):
        with pytest.raises(RuntimeError, match="asleep"):
            call()
    trainer.wake()
    trainer.begin_train_step(0)
    with pytest.raises(RuntimeError, match="while step 0 is open"):
        trainer.sleep()
    unloaded = TorchTrainer(small_model(), offload=False)
    unloaded.sleep()
    assert not unloaded.asleep  # a no-op without offload


@needs_gpu
def test_on_a_gpu_an_offloading_logprob_engine_holds_its_weights_only_while_scoring():
    batch = scored_batch()
    expected = TorchLogprob(small_model().to("cuda")).logprobs(batch)
    engine = TorchLogprob(small_model().to("cuda"), offload=True)
    assert engine.model.device.type == "cpu"  # at rest from the start
    seen = []
    hook = engine.model.module.register_forward_pre_hook(lambda module, args: seen.append(engine.model.device.type))
    assert torch.equal(engine.logprobs(batch), expected)
    hook.remove()
    assert seen and set(seen) == {"cuda"} and engine.model.device.type == "cpu"
    pushed = {name: tensor + 0.5 for name, tensor in small_model(seed=9).module.state_dict().items()}
    engine.update_weights(pushed, version=1, last=True)  # applied to the host copy
    resident = TorchLogprob(small_model().to("cuda"))
    resident.update_weights(pushed, version=1, last=True)
    assert torch.equal(engine.logprobs(batch), resident.logprobs(batch)) and engine.model.device.type == "cpu"


@needs_gpu
def test_on_a_gpu_the_torch_trainer_sleeps_in_host_memory_and_wakes_bit_for_bit():
    trainer = TorchTrainer(small_model().to("cuda"), lr=1e-2)
    batch = TorchGenerator(small_model().to("cuda"), max_new_tokens=4).generate(PROMPTS, 2, seed=0)
    batch["advantage"] = torch.linspace(-1, 1, len(batch["response_ids"]))
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, batch)
    trainer.finish_train_step(0)  # AdamW state exists now
    before = {name: t.detach().clone() for name, t in trainer.model.module.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in trainer.optimizer.state.values()]
    trainer.sleep()
    assert all(p.device.type == "cpu" for p in trainer.parameters)
    assert all(s["exp_avg"].device.type == "cpu" for s in trainer.optimizer.state.values())
    trainer.wake()
    assert all(p.device.type == "cuda" for p in trainer.parameters)
    assert all(torch.equal(t, before[name]) for name, t in trainer.model.module.state_dict().items())
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(trainer.optimizer.state.values(), moments))
    trainer.begin_train_step(1)
    trainer.train_microbatch(1, batch)
    assert trainer.finish_train_step(1).version == 2
