"""The megatron trainer on a CUDA GPU: what the CPU tests cannot cover.

Skipped without CUDA (CI has none). On a GPU machine, one process, one GPU:

- fp32 (TF32 off): the split-step gradient equals one full-batch backward
  of the normalised loss, as on CPU;
- bf16 with the distributed optimizer: steps train, a checkpoint resumes
  the same next step, and offload really frees GPU memory and gives the
  same next step after wake; a rollout batch in mini-batches with a token
  budget takes the steps separate rollout batches take; the proximal pass
  gives a second pass over the same rows the first pass's logprobs.

bf16 comparisons use tolerances, not equality: some CUDA backward kernels
(the embedding's) accumulate with atomics, so two runs may differ in the
last bits.
"""

from __future__ import annotations

import pytest
import torch

from rldsl.runtime.engines.policy_loss import PolicyLossConfig
from rldsl.runtime.engines.schedule import LRSchedule
from tests.test_megatron_engine import SHAPES, make_batch, make_trainer, random_hf_weights, reference_gradients

pytestmark = [pytest.mark.gpu, pytest.mark.megatron, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

BF16 = dict(dtype="bf16", distributed_optimizer=True, lr=1e-3, max_grad_norm=1.0,
            lr_schedule=LRSchedule("constant", warmup=4))


@pytest.fixture(scope="module")
def megatron_gpu():
    """megatron-core on the GPU (no shim), with one-process model-parallel groups."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'rldsl[gpu]')")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rldsl.runtime.engines.megatron import model as megatron_model

    created_group = not dist.is_initialized()
    megatron_model.ensure_model_parallel(tp=1, pp=1, seed=0)
    yield megatron_model
    parallel_state.destroy_model_parallel()
    if created_group:
        dist.destroy_process_group()


def step_on(trainer, shape, step: int):
    trainer.begin_train_step(step)
    trainer.train_microbatch(step, make_batch(shape))
    return trainer.finish_train_step(step)


def weights_of(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().cpu().clone() for name, p in trainer.model.module.named_parameters()}


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = max(float(b[name].abs().max()), 1e-6)
        assert float((a[name] - b[name]).abs().max()) / scale < rtol, name


@pytest.fixture
def no_tf32():
    """TF32 off for one test, then as it was (set and restored by hand: the
    cuBLAS flag is a module property, which monkeypatch cannot restore)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_split_step_gradient_equals_full_batch_gradient_on_cuda_fp32(megatron_gpu, no_tf32):
    shape = SHAPES["llama"]
    weights = random_hf_weights(shape, seed=1)
    batch = make_batch(shape)
    config = PolicyLossConfig(clip=0.2, kl=0.05, agg="token_mean")
    expected = reference_gradients(megatron_gpu, shape, weights, batch, config, device="cuda")
    trainer = make_trainer(shape, weights, loss=config, rows_per_forward=2)
    for step in range(2):  # the second step is the one a leftover no_sync hook breaks
        trainer.begin_train_step(step)
        for start, stop in [(0, 3), (3, 4), (4, 10)]:
            trainer.train_microbatch(step, {name: value[start:stop] for name, value in batch.items()})
        trainer.finish_train_step(step)
    actual = {name: p.main_grad.float().cpu() for name, p in trainer.model.module.named_parameters()}
    assert_close(actual, {name: g.cpu() for name, g in expected.items()}, rtol=1e-4)


def test_bf16_distributed_optimizer_trains_and_resumes_the_same_next_step(megatron_gpu, tmp_path):
    shape = SHAPES["qwen2"]
    first = make_trainer(shape, random_hf_weights(shape, seed=1), **BF16)
    before = weights_of(first)
    for step in range(2):
        result = step_on(first, shape, step)
    assert result.version == 2 and all(torch.isfinite(torch.tensor(v)) for v in result.metrics.values())
    assert any(not torch.equal(before[n], w) for n, w in weights_of(first).items())
    first.save_checkpoint(tmp_path)
    expected = step_on(first, shape, 2)
    resumed = make_trainer(shape, random_hf_weights(shape, seed=2), **BF16)
    assert resumed.load_checkpoint(tmp_path) == 2
    actual = step_on(resumed, shape, 2)
    assert actual.version == expected.version == 3
    assert actual.metrics["lr"] == expected.metrics["lr"]
    assert_close(weights_of(resumed), weights_of(first), rtol=1e-2)


def test_offload_frees_gpu_memory_and_wake_gives_the_same_next_step(megatron_gpu):
    shape = SHAPES["qwen2"]
    sleeper = make_trainer(shape, random_hf_weights(shape, seed=1), offload=True, **BF16)
    awake = make_trainer(shape, random_hf_weights(shape, seed=1), offload=True, **BF16)
    for trainer in (sleeper, awake):
        step_on(trainer, shape, 0)  # the optimizer state exists from the first step on
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    sleeper.sleep()
    torch.cuda.synchronize()
    freed = held - torch.cuda.memory_allocated()
    parameter_bytes = sum(p.numel() * p.element_size() for p in sleeper.model.module.parameters())
    assert sleeper.asleep and freed >= parameter_bytes  # weights, main params and Adam moments are gone
    sleeper.wake()
    assert not sleeper.asleep
    assert all(torch.equal(w, weights_of(awake)[n]) for n, w in weights_of(sleeper).items())  # an exact copy back
    expected, actual = step_on(awake, shape, 1), step_on(sleeper, shape, 1)
    assert actual.version == expected.version == 2
    assert_close(weights_of(sleeper), weights_of(awake), rtol=1e-2)


def test_bf16_mini_batches_with_a_token_budget_take_the_separate_steps(megatron_gpu):
    shape = SHAPES["qwen2"]
    batch = make_batch(shape)
    options = dict(BF16, tokens_per_forward=24)
    mini = make_trainer(shape, random_hf_weights(shape, seed=1), **options)
    separate = make_trainer(shape, random_hf_weights(shape, seed=1), **options)
    mini_batches = [(0, 4), (4, 7), (7, 10)]
    mini.begin_train_step(0)
    for index, (start, stop) in enumerate(mini_batches):
        mini.train_microbatch(0, {name: value[start:stop] for name, value in batch.items()})
        if index < len(mini_batches) - 1:
            mini.optimizer_step(0)
    result = mini.finish_train_step(0)
    for step, (start, stop) in enumerate(mini_batches):
        separate.begin_train_step(step)
        separate.train_microbatch(step, {name: value[start:stop] for name, value in batch.items()})
        separate.finish_train_step(step)
    assert result.version == 1 and result.metrics["optimizer_steps"] == 3.0
    assert mini.scheduler.num_steps == separate.scheduler.num_steps == 3
    assert all(torch.isfinite(torch.tensor(v)) for v in result.metrics.values())
    assert_close(weights_of(mini), weights_of(separate), rtol=1e-2)


def test_bf16_proximal_pass_gives_a_second_epoch_the_batch_start_logprobs(megatron_gpu, monkeypatch):
    """ppo_epochs = 2 with a correction: the second pass over the same rows
    trains against the logprobs the first pass took on the batch-start
    weights, though the first (held) optimizer step has moved them since."""
    from tests.test_megatron_proximal import record_losses

    shape = SHAPES["qwen2"]
    batch = make_batch(shape)
    calls = record_losses(monkeypatch)
    options = dict(BF16, lr=1e-2, lr_schedule=LRSchedule("constant"), rows_per_forward=4)
    trainer = make_trainer(shape, random_hf_weights(shape, seed=1),
                           loss=PolicyLossConfig(correction="tis", clip=0.02), **options)
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, batch)
    assert trainer.optimizer_step(0) == {"deferred": 1.0}
    trainer.train_microbatch(0, batch)
    result = trainer.finish_train_step(0)
    assert result.version == 1 and result.metrics["optimizer_steps"] == 2.0
    first, second = calls[:3], calls[3:]  # 10 rows, 4 a forward
    at_start = torch.cat([logprobs.float().cpu() for logprobs, _ in first])
    proximal = torch.cat([proximal.float().cpu() for _, proximal in second])
    trained_with = torch.cat([logprobs.float().cpu() for logprobs, _ in second])
    assert float((proximal - at_start).abs().max()) < 1e-3
    assert float((trained_with - at_start).abs().max()) > 1e-2  # the weights had moved
    assert result.metrics["clip_fraction"] > 0 and all(torch.isfinite(torch.tensor(v))
                                                       for v in result.metrics.values())
