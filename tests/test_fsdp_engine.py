"""The fsdp engine (torch FSDP2) on CPU over gloo.

- the split step's gradient (uneven microbatches, an idle rank, a token
  budget) equals one full-batch backward of the normalised loss: one
  process, dp 2 and 4 (full shard) and dp 4 with shard 2 (hybrid);
- a rollout batch in two optimizer steps bumps the version once;
- checkpoints restore weights, optimizer state, version and step count;
- weight buckets are the unsharded model's state dict, in the compute dtype,
  also gathered on the device beside the next step's microbatches;
- sleep / wake keep every value;
- the model is sharded as it is built: parameters on meta when sharded, no
  rank holding a full parameter, an ``hf:`` model read from its safetensors
  files one slice per rank;
- ranks with unequal microbatch and forward counts run the same number of
  forwards (padded) and no FSDP unit stays gathered between forwards;
- every layer checkpoints its activations: it runs its forward again in its
  backward (padded forwards included), and the gradient is unchanged.

The compiler's memory estimate for the engine is in tests/test_memory_model.py.

Multi-rank cases run every check in one spawn per world size (starting
processes dominates the time).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest

from tests.ports import free_port, start_ranks
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from rldsl.runtime.engines.fsdp import FsdpLogprob, FsdpTrainer
from rldsl.runtime.engines.fsdp import loading, sharding
from rldsl.runtime.engines.policy_loss import AGGREGATIONS, PolicyLossConfig
from rldsl.runtime.engines.torch.common import response_logprobs
from rldsl.runtime.protocols import LogprobEngine, Trainer
from tests.test_split_step_gradient import ROWS, full_batch_gradients, make_batch, make_model, max_relative_error

# tiny-lm returns its key/value cache as views; nothing here writes to them in place.
pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")
LOSS_CONFIGS = [PolicyLossConfig(clip=0.2, kl=0.05, agg=agg) for agg in AGGREGATIONS]
LAYOUTS = {  # world size -> rank -> microbatch row ranges (uneven; rank 1 idle in one)
    1: {"uneven": {0: [(0, 3), (3, 4), (4, 9), (9, 10)]}},
    2: {"uneven": {0: [(0, 2), (2, 3), (3, 7)], 1: [(7, 10)]}, "idle rank": {0: [(0, 4), (4, 10)], 1: []}},
    4: {"uneven": {0: [(0, 1), (1, 2)], 1: [(2, 6)], 2: [(6, 7), (7, 9)], 3: [(9, 10)]}},
}


def full_values(tensors) -> list[torch.Tensor]:
    """Sharded tensors gathered (a collective), on the CPU."""
    return [(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu() for t in tensors]


def split_step_error(model, batch, config, rows, **options) -> float:
    expected = full_batch_gradients(model, batch, config)
    trainer = FsdpTrainer(copy.deepcopy(model), loss=config, lr=0.0, max_grad_norm=None, **options)
    trainer.begin_train_step(0)
    for start, stop in rows:
        trainer.train_microbatch(0, {name: value[start:stop] for name, value in batch.items()})
    assert trainer.finish_train_step(0).version == 1
    return max_relative_error(full_values(p.grad for p in trainer.parameters), expected)


def gradient_errors(world_size: int, rank: int, **options) -> dict:
    model = make_model()
    batch = make_batch(model)
    errors = {}
    for config in LOSS_CONFIGS:
        for name, layout in LAYOUTS[world_size].items():
            errors[(config.agg, name)] = split_step_error(model, batch, config, layout[rank], **options)
    budget_rows = [(0, 6), (6, 10)] if rank == 0 else []
    errors[("budget", 12)] = split_step_error(model, batch, LOSS_CONFIGS[0], budget_rows, tokens_per_forward=12,
                                              **options)
    return errors


def two_optimizer_steps(batch, **options) -> FsdpTrainer:
    trainer = FsdpTrainer(make_model(), lr=1e-2, **options)
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, {name: value[:5] for name, value in batch.items()})
    trainer.optimizer_step(0)
    assert trainer.version == 0 and trainer.optimizer_steps == 1
    trainer.train_microbatch(0, {name: value[5:] for name, value in batch.items()})
    result = trainer.finish_train_step(0)
    assert (result.version, trainer.optimizer_steps) == (1, 2)
    assert "skipped" not in result.metrics
    return trainer


def full_optimizer_state(trainer) -> dict:
    state = get_optimizer_state_dict(trainer.model.module, trainer.optimizer,
                                     options=StateDictOptions(full_state_dict=True))
    return {(name, key): value for name, entry in state["state"].items() for key, value in entry.items()}


def checkpoint_round_trip(batch, directory, **options) -> None:
    trainer = two_optimizer_steps(batch, **options)
    trainer.save_checkpoint(directory)
    shards = Path(directory) / "fsdp"  # each rank wrote its own shards; nothing was gathered into one file
    assert list(shards.glob(f"__{dist.get_rank()}_*.distcp")) and not (Path(directory) / "fsdp.pt").exists()
    restored = FsdpTrainer(make_model(), lr=1e-2, **options)
    assert restored.load_checkpoint(directory) == 1 and restored.optimizer_steps == 2
    for a, b in zip(full_values(trainer.parameters), full_values(restored.parameters)):
        assert torch.equal(a, b)
    saved, loaded = full_optimizer_state(trainer), full_optimizer_state(restored)
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        assert torch.equal(torch.as_tensor(value).cpu(), torch.as_tensor(loaded[key]).cpu()), key


def buckets_match_the_model(**options) -> None:
    model = make_model()
    expected = {name: tensor.clone() for name, tensor in model.module.state_dict().items()}
    trainer = FsdpTrainer(copy.deepcopy(model), **options)
    buckets = list(gathers_streamed(trainer.weight_buckets(bucket_bytes=4096)))
    if dist.get_rank() != 0:
        assert buckets == []
        return
    assert len(buckets) > 1
    got = {name: tensor for bucket in buckets for name, tensor in bucket.items()}
    assert list(got) == list(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def export_beside_a_step(batch, **options) -> None:
    """The weights exported on another thread while this one trains the next
    step's microbatches (on Ray: the push's concurrency group beside the
    step's calls), gathered where the shards are (``on_host=False``, a
    rank-to-rank push): the microbatches only keep their rows, so the
    export's gathers are the only collectives on the group and it neither
    hangs nor mixes; its buckets equal the host copies taken before, and the
    step then trains."""
    import threading

    trainer = two_optimizer_steps(batch, **options)
    before = [bucket for bucket in trainer.weight_buckets(4096)]
    beside = []
    thread = threading.Thread(target=lambda: beside.extend(trainer.weight_buckets(4096, on_host=False)))
    trainer.begin_train_step(1)
    thread.start()
    trainer.train_microbatch(1, {name: value[:5] for name, value in batch.items()})
    trainer.train_microbatch(1, {name: value[5:] for name, value in batch.items()})
    thread.join(timeout=120)
    assert not thread.is_alive(), "the export beside the step hung"
    assert [list(b) for b in beside] == [list(b) for b in before]
    assert all(torch.equal(b[name].cpu(), a[name]) for a, b in zip(before, beside) for name in a)
    assert trainer.finish_train_step(1).version == 2


def gathers_streamed(buckets):
    """Yields ``buckets``, checking that each arrives before any tensor of the
    next one was gathered (counting ``DTensor.full_tensor`` calls)."""
    full_tensor, gathered = DTensor.full_tensor, []
    DTensor.full_tensor = lambda self, **kwargs: gathered.append(1) or full_tensor(self, **kwargs)
    try:
        received = 0
        for bucket in buckets:
            received += len(bucket)
            assert len(gathered) == received
            yield bucket
    finally:
        DTensor.full_tensor = full_tensor


def sleep_and_wake_keep_values(batch, **options) -> None:
    trainer = two_optimizer_steps(batch, **options)
    before = [t.to_local().clone() for t in trainer.parameters]
    trainer.sleep()
    assert trainer.asleep and all(t.device.type in ("cpu", "meta") for t in trainer.parameters)
    with pytest.raises(RuntimeError, match="asleep"):
        trainer.begin_train_step(1)
    trainer.wake()
    assert not trainer.asleep
    assert all(torch.equal(a, t.to_local()) for a, t in zip(before, trainer.parameters))
    two_steps_after_wake(trainer, batch)


def two_steps_after_wake(trainer, batch) -> None:
    trainer.begin_train_step(1)
    trainer.train_microbatch(1, batch)
    assert trainer.finish_train_step(1).version == 2


def built_sharded_on_meta(**options) -> None:
    """Every unit is sharded while its parameters are on meta, and afterwards
    no rank holds more than its chunk of any parameter's rows; the chunks of
    one shard group add up to the full tensors."""
    seen = []

    def observed(module, **kwargs):
        seen.append(all(p.is_meta for p in module.parameters()))
        return fully_shard(module, **kwargs)

    fully_shard = sharding.fully_shard
    sharding.fully_shard = observed
    try:
        trainer = FsdpTrainer(make_model(), **options)
    finally:
        sharding.fully_shard = fully_shard
    assert seen and all(seen)
    full = make_model().module.state_dict()
    shard_ranks = trainer.mesh.size(trainer.mesh.ndim - 1)
    held = torch.zeros(1, dtype=torch.int64)
    for name, param in trainer.model.module.named_parameters():
        local = param.to_local()
        assert local.shape[0] <= -(-full[name].shape[0] // shard_ranks), name
        held += local.numel()
    dist.all_reduce(held)
    copies = dist.get_world_size() // shard_ranks
    assert int(held) == copies * sum(t.numel() for t in full.values())


def unequal_microbatches_in_lockstep(rank: int, **options) -> float:
    """Rank 0 trains 3 microbatches (5 forwards), rank 1 one (1 forward), the
    rest none: every rank runs 5 forwards, each layer recomputed once in its
    backward, no unit is gathered when a forward starts, a layer's forward
    sees no other layer gathered, and the gradient is the full batch's.
    Returns the gradient's relative error."""
    model = make_model()
    batch = make_batch(model)
    config = LOSS_CONFIGS[0]
    trainer = FsdpTrainer(copy.deepcopy(model), loss=config, lr=0.0, max_grad_norm=None, rows_per_forward=2,
                          **options)
    root = trainer.model.module
    gathered_at_start = []
    root.register_forward_pre_hook(lambda *_: gathered_at_start.append(sharding.gathered_parameters(root)),
                                   prepend=True)  # before FSDP's own hook gathers the root
    for index, block in enumerate(root.blocks):
        block.register_forward_pre_hook(lambda _, __, index=index: check_only_layer_gathered(root, index))
    layer_runs = count_layer_runs(root)
    rows = {0: [(0, 3), (3, 4), (4, 8)], 1: [(8, 10)]}.get(rank, [])
    trainer.begin_train_step(0)
    for start, stop in rows:
        counts = trainer.train_microbatch(0, {name: value[start:stop] for name, value in batch.items()})
        assert counts["tokens"] == float(batch["response_mask"][start:stop].sum())
    assert gathered_at_start == []  # microbatches only queue their rows
    trainer.finish_train_step(0)
    assert len(gathered_at_start) == 5 and not any(gathered_at_start)
    assert layer_runs == [2 * 5] * len(root.blocks)  # each forward's layers run again in its backward
    assert sharding.gathered_parameters(root) == []
    grads = full_values(p.grad for p in trainer.parameters)
    return max_relative_error(grads, full_batch_gradients(model, batch, config))


def count_layer_runs(root) -> list[int]:
    """How often each block's layer computation runs, counted at its
    attention (the recompute calls the block's forward, not the block)."""
    runs = [0] * len(root.blocks)
    for index, block in enumerate(root.blocks):
        block.attn.register_forward_pre_hook(lambda *_, index=index: runs.__setitem__(index, runs[index] + 1))
    return runs


def check_only_layer_gathered(root, index: int) -> None:
    layers = {name.split(".")[1] for name in sharding.gathered_parameters(root) if name.startswith("blocks.")}
    assert layers == {str(index)}, (index, layers)


def _worker(rank: int, world_size: int, shards: tuple[int, ...], port: int, directory: str, results: dict):
    """Every layout of ``shards`` in turn on one process group (a spawn of the ranks costs seconds)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        for shard in shards:
            results[(shard, rank)] = _one_layout(rank, world_size, shard, os.path.join(directory, f"shard{shard}"))
    finally:
        dist.destroy_process_group()


def _one_layout(rank: int, world_size: int, shard: int, directory: str) -> dict:
    options = {"shard": shard}
    assert FsdpTrainer(make_model(), **options).mesh.shape == ((world_size // shard, shard) if shard else
                                                               (world_size,))
    found = {rank: gradient_errors(world_size, rank, **options)}
    built_sharded_on_meta(**options)
    found[(rank, "lockstep")] = unequal_microbatches_in_lockstep(rank, **options)
    batch = make_batch(make_model())
    checkpoint_round_trip(batch, directory, **options)
    buckets_match_the_model(**options)
    export_beside_a_step(batch, **options)
    sleep_and_wake_keep_values(batch, **options)
    found[(rank, "done")] = True
    return found


def run_ranks(world_size: int, shards: int | tuple[int, ...], directory, worker=_worker) -> dict:
    """The ranks' results; for several ``shards`` (layouts run one after another) a dict per layout."""
    layouts = shards if isinstance(shards, tuple) else (shards,)
    results = start_ranks(worker, (world_size, layouts, free_port(), str(directory)), nprocs=world_size)
    per_layout = {shard: {key: value for rank in range(world_size) for key, value in
                          results.get((shard, rank), {}).items()} for shard in layouts}
    return per_layout if isinstance(shards, tuple) else per_layout[shards]


def assert_all_ranks_exact(results: dict, world_size: int) -> None:
    assert all(results.get((rank, "done")) for rank in range(world_size)), results
    worst = max(error for rank in range(world_size) for error in results[rank].values())
    assert worst < 1e-5, results
    assert max(results[(rank, "lockstep")] for rank in range(world_size)) < 1e-5, results


def test_one_rank_matches_full_batch_and_keeps_state(one_process_group, tmp_path):
    errors = gradient_errors(1, 0)
    assert max(errors.values()) < 1e-5, errors
    batch = make_batch(make_model())
    checkpoint_round_trip(batch, tmp_path)
    buckets_match_the_model()
    export_beside_a_step(batch)
    sleep_and_wake_keep_values(batch)
    assert isinstance(FsdpTrainer(make_model()), Trainer)


def test_a_checkpoint_written_before_as_one_gathered_file_still_loads(one_process_group, tmp_path):
    from rldsl.runtime.atomic import save_torch_state
    from torch.distributed.checkpoint.state_dict import get_state_dict

    trainer = two_optimizer_steps(make_batch(make_model()))
    model_state, optimizer_state = get_state_dict(trainer.model.module, trainer.optimizer,
                                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    save_torch_state(tmp_path / "fsdp.pt", {"model": model_state, "optimizer": optimizer_state, "version": 1,
                                            "optimizer_steps": 2})  # as every checkpoint was written before
    restored = FsdpTrainer(make_model(), lr=1e-2)
    assert restored.load_checkpoint(tmp_path) == 1 and restored.optimizer_steps == 2
    for a, b in zip(full_values(trainer.parameters), full_values(restored.parameters)):
        assert torch.equal(a, b)


def test_layers_recompute_only_when_training(one_process_group):
    """A forward without gradients runs each layer once and keeps nothing to
    recompute; a training forward saves less than an unchecked one (only the
    layers' inputs, not their activations)."""
    model = make_model()
    batch = make_batch(model)
    trainer = FsdpTrainer(copy.deepcopy(model))
    runs = count_layer_runs(trainer.model.module)
    with torch.no_grad():
        response_logprobs(trainer.model, batch)
    assert runs == [1] * len(runs)
    assert saved_bytes(trainer.model, batch) < saved_bytes(model, batch) / 2


def saved_bytes(model, batch) -> int:
    """Bytes a training forward keeps for its backward (outside checkpointed regions)."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        response_logprobs(model, batch)
    return sum(saved)


def test_bf16_compute_stays_close_to_fp32(one_process_group):
    model = make_model()
    batch = make_batch(model)
    error = split_step_error(model, batch, LOSS_CONFIGS[0], LAYOUTS[1]["uneven"][0], dtype="bf16")
    assert error < 5e-2  # bf16 forwards against an fp32 reference
    trainer = FsdpTrainer(make_model(), dtype="bf16")
    assert all(p.dtype == torch.float32 for p in trainer.parameters)  # fp32 master shards
    pushed = {name: t for bucket in trainer.weight_buckets(bucket_bytes=4096) for name, t in bucket.items()}
    masters = model.module.state_dict()
    assert all(t.dtype == torch.bfloat16 for t in pushed.values())  # pushes in the compute dtype: half the bytes
    assert all(torch.equal(pushed[name], masters[name].to(torch.bfloat16)) for name in masters)


def test_abort_drops_unreduced_gradients(one_process_group):
    model = make_model()
    batch = make_batch(model)
    config = LOSS_CONFIGS[0]
    trainer = FsdpTrainer(copy.deepcopy(model), loss=config, lr=0.0, max_grad_norm=None)
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, {name: value[:4] for name, value in batch.items()})
    trainer.abort_train_step(0)
    trainer.begin_train_step(1)
    trainer.train_microbatch(1, batch)
    trainer.finish_train_step(1)
    grads = full_values(p.grad for p in trainer.parameters)
    assert max_relative_error(grads, full_batch_gradients(model, batch, config)) < 1e-5


def test_logprob_engine_matches_the_torch_engine():
    model = make_model()
    batch = make_batch(model)
    engine = FsdpLogprob(copy.deepcopy(model), rows_per_forward=3)
    assert isinstance(engine, LogprobEngine)
    with torch.no_grad():
        expected = response_logprobs(model, batch)
    assert torch.allclose(engine.logprobs(batch), expected, atol=1e-5)
    assert engine.logprobs(batch).shape == (ROWS, batch["response_ids"].shape[1])


def test_data_parallel_two_ranks(tmp_path):
    assert_all_ranks_exact(run_ranks(2, 0, tmp_path), 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    """Four ranks spawned once for both four-rank layouts: full shard (0) and two ranks per copy (2)."""
    return run_ranks(4, (0, 2), tmp_path_factory.mktemp("four_ranks"))


def test_data_parallel_four_ranks_full_shard(four_ranks):
    assert_all_ranks_exact(four_ranks[0], 4)


def test_hybrid_sharding_four_ranks_two_per_copy(four_ranks):
    assert_all_ranks_exact(four_ranks[2], 4)


def read_bytes_counted() -> list[int]:
    """Wraps the safetensors row reader (in this spawned process); the list
    collects the bytes each read returned."""
    from rldsl.models.hf_checkpoint import SafetensorsCheckpoint

    read: list[int] = []
    original = SafetensorsCheckpoint.read_slice

    def counting(self, name, dim, start, stop):
        rows = original(self, name, dim, start, stop)
        read.append(rows.numel() * rows.element_size())
        return rows

    SafetensorsCheckpoint.read_slice = counting
    return read


def _hf_worker(rank: int, world_size: int, shards: tuple[int, ...], port: int, directory: str, results: dict):
    from safetensors.torch import load_file

    (shard,) = shards
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        read = read_bytes_counted()
        trainer = FsdpTrainer(loading.meta_hf_model(f"hf:{directory}"), shard=shard)
        found = {(rank, "read"): sum(read)}
        buckets = list(trainer.weight_buckets(bucket_bytes=8192))
        if rank == 0:
            saved = load_file(os.path.join(directory, "model.safetensors"))
            got = {name: tensor for bucket in buckets for name, tensor in bucket.items()}
            found["file bytes"] = sum(t.numel() * t.element_size() for t in saved.values())
            found["equal"] = got.keys() == saved.keys() and all(torch.equal(got[n], saved[n]) for n in saved)
        found[(rank, "done")] = True
        results[(shard, rank)] = found
    finally:
        dist.destroy_process_group()


def test_hf_model_loads_sharded_from_safetensors(tmp_path):
    """Two ranks build a Hugging Face Llama on meta and each reads only its
    rows of the checkpoint: the gathered weights are the file's, and each
    rank read about half of its bytes."""
    from tests.hf_tiny import save_char_llama

    path = save_char_llama(tmp_path / "llama")
    results = run_ranks(2, 0, path, worker=_hf_worker)
    assert results[(0, "done")] and results[(1, "done")] and results["equal"]
    total = results["file bytes"]
    assert results[(0, "read")] + results[(1, "read")] == total
    assert all(abs(results[(rank, "read")] - total / 2) < 0.05 * total for rank in (0, 1)), results


def test_tied_hf_model_built_on_meta_matches_the_pretrained_load(one_process_group, tmp_path):
    """Tied embeddings (no ``lm_head.weight`` in the file) and the rotary
    buffers (in no file) come out as ``from_pretrained`` makes them."""
    from rldsl.models import load_model
    from tests.hf_tiny import save_char_llama

    source = f"hf:{save_char_llama(tmp_path / 'llama', tie_word_embeddings=True)}"
    pretrained = load_model(source)
    batch = make_batch(pretrained)
    trainer = FsdpTrainer(loading.meta_hf_model(source))
    assert all(p.is_meta for p in loading.meta_hf_model(source).module.parameters())
    with torch.no_grad():
        assert torch.equal(response_logprobs(trainer.model, batch), response_logprobs(pretrained, batch))
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, batch)
    assert trainer.finish_train_step(0).version == 1


def fsdp_plan(train_engine: str, reference_engine: str = "fsdp"):
    from pathlib import Path

    from rldsl.compiler.driver import compile_source

    path = Path(__file__).parent.parent / "pipelines" / "grpo_async.rlp"
    text = path.read_text().replace("  engine = torch\n  gpus = 1\n  prompts_per_step",
                                    f"  engine = {train_engine}\n  gpus = 1\n  prompts_per_step")
    text = text.replace("frozen  colocate = actor", f"frozen  colocate = actor  engine = {reference_engine}")
    return compile_source(text, str(path), base_dir=path.parent)


def test_the_factory_builds_fsdp_stages(one_process_group, monkeypatch):
    from rldsl.runtime.engines import factory

    result = fsdp_plan("fsdp(dtype = bf16)")
    assert result.ok, [d.message for d in result.diagnostics if d.is_error]
    pipe = result.plan.pipelines[0]
    train = next(stage for stage in pipe.stages if stage.kind == "train")
    assert train.engine.args == {"shard": 0, "offload": True, "dtype": "bf16"}
    monkeypatch.setattr(factory, "load_policy", lambda *args: make_model())
    trainer = factory.build_trainer(train, pipe, seed=0)
    assert isinstance(trainer, FsdpTrainer) and trainer.dtype == "bf16" and trainer.offload
    reference = next(stage for stage in pipe.stages if stage.kind == "logprob")
    assert isinstance(factory.build_logprob(reference, pipe, seed=0), FsdpLogprob)


@pytest.mark.parametrize("engine", ["fsdp(shard = -1)", "fsdp(dtype = fp16)", "fsdp(tp = 2)"])
def test_bad_fsdp_arguments_are_rejected(engine):
    assert not fsdp_plan(engine).ok
