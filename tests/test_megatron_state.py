"""MegatronTrainer outside a step, on CPU (megatron-core under the test-only
compat shim): checkpoints (one file per rank) and offload (sleep/wake).

- save after 2 steps, load into a trainer built from other weights: the
  3rd step gives the same weights, optimizer moments, LR and version as
  the uninterrupted run (one process, and dp = 2 over gloo);
- a checkpoint of another layout, or a missing rank file, is a clear error;
  saving, loading or sleeping inside an open step is refused;
- with offload, sleep frees every device storage in place and wake brings
  it back: the next step is bit-identical to a trainer that never slept;
  without offload both change nothing.

The tests also run with Megatron's DistributedOptimizer on one rank, in fp32
and in bf16: its only CUDA assumption there is a ``param.type()`` check at
construction, which ``cuda_typed_tensors`` satisfies. NCCL needs a GPU.
"""

from __future__ import annotations


import pytest
import torch

from rldsl.runtime.engines.schedule import LRSchedule
from tests.ports import spawn_ranks
from tests.test_megatron_engine import SHAPES, make_batch, make_trainer, random_hf_weights, run_clean_step

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# bf16: the norms stay fp32, so a parameter group mixes dtypes (see state._reshape_placeholder_states)
OPTIMIZERS = ["fp32", "distributed", "bf16-distributed"]
# warmup then cosine decay: every step's LR depends on the scheduler state
TRAINING = dict(lr=1e-2, max_grad_norm=1.0, lr_schedule=LRSchedule("cosine", warmup=2, total=6, min_lr=1e-3))


@pytest.fixture
def cuda_typed_tensors(monkeypatch):
    """``Tensor.type()`` names CPU tensors as CUDA ones (DistributedOptimizer checks the name)."""
    original = torch.Tensor.type

    def cuda_named(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if not args and not kwargs and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name

    monkeypatch.setattr(torch.Tensor, "type", cuda_named)


@pytest.fixture(params=OPTIMIZERS)
def optimizer_options(request):
    if request.param == "fp32":
        return {"distributed_optimizer": False}
    request.getfixturevalue("cuda_typed_tensors")
    return {"distributed_optimizer": True, "dtype": "bf16" if request.param.startswith("bf16") else "fp32"}


def weights_of(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.module.named_parameters()}


def optimizer_state(trainer) -> dict[str, torch.Tensor]:
    """Main parameters and optimizer state by position (the state's key order may differ after a load)."""
    from rldsl.runtime.engines.megatron.state import sub_optimizers

    state = {}
    for i, sub in enumerate(sub_optimizers(trainer.optimizer)):
        for g, group in enumerate(sub.optimizer.param_groups):
            for n, param in enumerate(group["params"]):
                state[f"{i}.{g}.{n}.param"] = param.detach().clone()
                state.update({f"{i}.{g}.{n}.{k}": v.clone() for k, v in sub.optimizer.state[param].items()})
    return state


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, different


# -- checkpoints ------------------------------------------------------------------


@pytest.mark.megatron
def test_resume_from_a_checkpoint_gives_the_same_third_step(megatron, optimizer_options, tmp_path):
    shape = SHAPES["qwen2"]
    first = make_trainer(shape, random_hf_weights(shape, seed=1), **TRAINING, **optimizer_options)
    for step in range(2):
        run_clean_step(first, shape, step)
    first.save_checkpoint(tmp_path)
    assert sorted(p.name for p in (tmp_path / "megatron").iterdir()) == ["rank00000.pt"]  # no .tmp left
    expected = run_clean_step(first, shape, 2)

    resumed = make_trainer(shape, random_hf_weights(shape, seed=2), **TRAINING, **optimizer_options)
    assert resumed.load_checkpoint(tmp_path) == 2 and resumed.version == 2
    actual = run_clean_step(resumed, shape, 2)
    assert actual.version == expected.version == 3
    assert actual.metrics == expected.metrics  # loss, grad norm and the LR of the warmup
    assert actual.metrics["lr"] == pytest.approx(TRAINING["lr_schedule"].lr_at(2, 1e-2))  # not step 0's 0.0
    assert_same(weights_of(resumed), weights_of(first))
    assert_same(optimizer_state(resumed), optimizer_state(first))
    assert resumed.scheduler.num_steps == first.scheduler.num_steps == 3


@pytest.mark.megatron
def test_a_checkpoint_of_another_layout_or_rank_is_a_clear_error(megatron, tmp_path):
    from rldsl.runtime.engines.megatron.state import checkpoint_file

    shape = SHAPES["llama"]
    trainer = make_trainer(shape, random_hf_weights(shape), lr=1e-2)
    with pytest.raises(FileNotFoundError, match="rank00000.pt does not exist"):
        trainer.load_checkpoint(tmp_path)
    trainer.save_checkpoint(tmp_path)
    path = checkpoint_file(tmp_path, 0)
    state = torch.load(path, weights_only=False)
    state["layout"].update(dp=2, world_size=2)
    torch.save(state, path)
    with pytest.raises(RuntimeError, match=r"saved with layout .*'dp': 2.* runs layout .*'dp': 1.*"
                                           r"same tp/pp/dp.*resharding is not supported"):
        trainer.load_checkpoint(tmp_path)
    state["layout"].update(dp=1, world_size=1)
    state["experts"].update(ep=2)  # the same ranks, another expert layout
    torch.save(state, path)
    with pytest.raises(RuntimeError, match=r"saved with ep = 2, etp = 1 but this trainer runs ep = 1, etp = 1"):
        trainer.load_checkpoint(tmp_path)
    del state["experts"]  # a file written before expert layouts were saved: read as before
    torch.save(state, path)
    assert trainer.load_checkpoint(tmp_path) == 0


@pytest.mark.megatron
def test_checkpoints_and_sleep_are_refused_inside_a_step(megatron, tmp_path):
    shape = SHAPES["llama"]
    trainer = make_trainer(shape, random_hf_weights(shape), lr=1e-2, offload=True)
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, make_batch(shape))
    for call in (lambda: trainer.save_checkpoint(tmp_path), lambda: trainer.load_checkpoint(tmp_path),
                 trainer.sleep):
        with pytest.raises(RuntimeError, match="step 0 is open"):
            call()
    assert not (tmp_path / "megatron").exists() and not trainer._offload.asleep
    trainer.finish_train_step(0)
    trainer.save_checkpoint(tmp_path)
    assert trainer.load_checkpoint(tmp_path) == 1


# -- offload ----------------------------------------------------------------------


def device_tensors(trainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(kept, dropped) as sleep sees them: the parameters, the optimizer's tensors; the grad buffers."""
    from rldsl.runtime.engines.megatron.state import offload_tensors

    return offload_tensors(trainer.model, trainer.optimizer)


@pytest.mark.megatron
def test_sleep_frees_the_storages_and_wake_gives_a_bit_identical_next_step(megatron, optimizer_options):
    from rldsl.runtime.engines.megatron.state import sub_optimizers

    shape = SHAPES["qwen2"]
    weights = random_hf_weights(shape, seed=3)
    sleeper = make_trainer(shape, weights, offload=True, **TRAINING, **optimizer_options)
    awake = make_trainer(shape, weights, offload=False, **TRAINING, **optimizer_options)
    for trainer in (sleeper, awake):
        run_clean_step(trainer, shape, 0)
    kept, dropped = device_tensors(sleeper)
    if optimizer_options["distributed_optimizer"]:  # DDP's contiguous param buffer holds the parameters
        assert all(buffer.param_data is not None for buffer in sleeper.model.buffers)
    params = list(sleeper.model.module.parameters())
    moments = [value for sub in sub_optimizers(sleeper.optimizer) for per_param in sub.optimizer.state.values()
               for key, value in per_param.items() if key.startswith("exp_avg")]
    assert moments
    views = [p.data for p in params] + [p.main_grad for p in params] + moments

    sleeper.sleep()
    sleeper.sleep()  # idempotent
    assert all(t.untyped_storage().nbytes() == 0 for t in kept + dropped + views)
    with pytest.raises(RuntimeError, match="asleep"):
        sleeper.begin_train_step(1)
    with pytest.raises(RuntimeError, match="asleep"):
        next(sleeper.weight_buckets(1 << 20))
    sleeper.wake()
    sleeper.wake()  # idempotent
    assert all(t.untyped_storage().nbytes() > 0 for t in kept + dropped)
    assert all(float(t.abs().max()) == 0 for t in dropped)  # gradients come back as zeros
    if optimizer_options["distributed_optimizer"]:  # the parameters still live in DDP's param buffer
        buffers = {buffer.param_data.untyped_storage().data_ptr() for buffer in sleeper.model.buffers}  # one a dtype
        assert all(p.untyped_storage().data_ptr() in buffers for p in sleeper.model.module.parameters())

    for step in (1, 2):  # a sleep between steps, and a step after a second sleep
        results = [run_clean_step(trainer, shape, step) for trainer in (sleeper, awake)]
        assert results[0].metrics == results[1].metrics
        assert_same(weights_of(sleeper), weights_of(awake))
        sleeper.sleep()
        sleeper.wake()
    assert_same(optimizer_state(sleeper), optimizer_state(awake))


@pytest.mark.megatron
def test_sleep_and_wake_change_nothing_without_offload(megatron):
    shape = SHAPES["llama"]
    trainer = make_trainer(shape, random_hf_weights(shape), offload=False, lr=1e-2)
    run_clean_step(trainer, shape, 0)
    kept, dropped = device_tensors(trainer)
    before = [(t.data_ptr(), t.clone()) for t in kept + dropped]
    trainer.sleep()
    assert not trainer._offload.asleep
    assert all(t.data_ptr() == ptr and torch.equal(t, copy) for t, (ptr, copy) in zip(kept + dropped, before))
    trainer.wake()
    assert all(t.data_ptr() == ptr and torch.equal(t, copy) for t, (ptr, copy) in zip(kept + dropped, before))
    assert run_clean_step(trainer, shape, 1).version == 2


@pytest.mark.megatron
def test_offload_survives_a_checkpoint_load(megatron, tmp_path):
    """torch.load's storages cannot be resized: load copies what the optimizer would keep of them."""
    shape = SHAPES["llama"]
    trainer = make_trainer(shape, random_hf_weights(shape), offload=True, lr=1e-2)
    run_clean_step(trainer, shape, 0)
    trainer.save_checkpoint(tmp_path)
    resumed = make_trainer(shape, random_hf_weights(shape, seed=5), offload=True, lr=1e-2)
    resumed.load_checkpoint(tmp_path)
    resumed.sleep()
    resumed.wake()
    assert run_clean_step(resumed, shape, 1).metrics == run_clean_step(trainer, shape, 1).metrics
    assert_same(weights_of(resumed), weights_of(trainer))


# -- two processes over gloo: dp = 2 ---------------------------------------------------

DP2_ROWS = {0: [(0, 3), (3, 7)], 1: [(7, 10)]}


def _dp2_worker(rank: int, port: int, directory: str, results: dict):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state

    from rldsl.runtime.engines.megatron import model as megatron_model
    from rldsl.runtime.engines.megatron.cpu_compat import megatron_on_cpu
    from rldsl.runtime.engines.megatron.state import checkpoint_file

    shape = SHAPES["qwen2"]
    batch = make_batch(shape)

    def step(trainer, index):
        trainer.begin_train_step(index)
        for start, stop in DP2_ROWS[rank]:
            trainer.train_microbatch(index, {k: v[start:stop] for k, v in batch.items()})
        return trainer.finish_train_step(index)

    try:
        with megatron_on_cpu():
            megatron_model.ensure_model_parallel(1, 1, seed=0)
            first = make_trainer(shape, random_hf_weights(shape, seed=1), **TRAINING)
            for index in range(2):
                step(first, index)
            first.save_checkpoint(directory)
            both_written = all(checkpoint_file(directory, r).exists() for r in range(2))
            expected = step(first, 2)
            resumed = make_trainer(shape, random_hf_weights(shape, seed=2), **TRAINING)
            version = resumed.load_checkpoint(directory)
            actual = step(resumed, 2)
            results[rank] = (both_written, version, actual.version == expected.version == 3,
                             actual.metrics == expected.metrics, weights_of(resumed), weights_of(first))
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


@pytest.mark.megatron
def test_resume_from_a_checkpoint_on_two_data_parallel_ranks(megatron, tmp_path):
    results = spawn_ranks(_dp2_worker, str(tmp_path))
    for rank in range(2):
        both_written, version, versions_match, metrics_match, resumed, first = results[rank]
        assert both_written and version == 2 and versions_match and metrics_match, rank
        assert_same(resumed, first)
    assert_same(results[0][4], results[1][4])  # the replicas agree
