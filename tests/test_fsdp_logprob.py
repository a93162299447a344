"""The fsdp logprob engine sharded over CPU processes (gloo).

- logprobs equal the unsharded model's on every rank: full shard over 2
  and 4 ranks, hybrid (shard 2 of 4 ranks), by rows and by token budget,
  with ranks whose shares need different numbers of forwards (padded);
- each rank keeps about 1 / shard of the parameter bytes, in the compute
  dtype, and nothing stays gathered after a call;
- a policy stage's weight push (full tensors) lands in the shards, and its
  snapshot is the full weights;
- an ``hf:`` model is read one slice per rank.

The memory model of a sharded logprob stage is in tests/test_memory_model.py.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from rldsl.runtime.engines.fsdp import FsdpLogprob, loading, sharding
from rldsl.runtime.engines.torch.common import response_logprobs
from tests.ports import free_port, start_ranks
from tests.test_fsdp_engine import read_bytes_counted
from tests.test_split_step_gradient import make_batch, make_model

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")


def parameter_bytes(module) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole model) over the parameters."""
    held = full = 0
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        held += local.numel() * local.element_size()
        full += param.numel() * param.element_size()
    return held, full


def forwards_counted(module) -> list[int]:
    runs = [0]
    module.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return runs


def sharded_matches_unsharded(shard: int, results: dict, rank: int) -> None:
    model = make_model()
    batch = make_batch(model)
    with torch.no_grad():
        expected = response_logprobs(model, batch)
    for options in ({"rows_per_forward": 2}, {"tokens_per_forward": 12}, {}):
        engine = FsdpLogprob(copy.deepcopy(model), shard=shard, **options)
        assert engine.mesh is not None
        runs = forwards_counted(engine.model.module)
        got = engine.logprobs(batch)
        assert got.shape == expected.shape
        results[(rank, "error", str(options))] = float((got - expected).abs().max())
        results[(rank, "forwards", str(options))] = runs[0]
        assert sharding.gathered_parameters(engine.model.module) == []
    held, full = parameter_bytes(engine.model.module)
    results[(rank, "held")], results["full"] = held, full
    assert all(p.dtype == torch.float32 for p in engine.model.module.parameters())
    bf16 = FsdpLogprob(copy.deepcopy(model), dtype="bf16", shard=shard)
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.module.parameters())
    assert (bf16.logprobs(batch) - expected).abs().max() < 0.1


def pushed_weights_land_in_the_shards(shard: int) -> None:
    """A policy stage: a push of another model's weights scores like that
    model; the snapshot is the full weights it started with."""
    start, target = make_model(), make_model()
    with torch.no_grad():
        for param in target.module.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    engine = FsdpLogprob(copy.deepcopy(start), shard=shard, rows_per_forward=3)
    snapshot = engine.weight_snapshot()[0]
    assert all(torch.equal(snapshot[name], value) for name, value in start.module.state_dict().items())
    names = list(target.module.state_dict().items())
    half = len(names) // 2
    engine.update_weights(dict(names[:half]), 1, last=False)
    with pytest.raises(RuntimeError, match="in progress"):
        engine.logprobs(make_batch(target))
    engine.update_weights(dict(names[half:]), 1, last=True)
    assert engine.version == 1
    batch = make_batch(target)
    with torch.no_grad():
        expected = response_logprobs(target, batch)
    assert torch.allclose(engine.logprobs(batch), expected, atol=1e-6)


def _worker(rank: int, world_size: int, shards: tuple[int, ...], port: int, directory: str, results: dict):
    """Every layout of ``shards`` in turn on one process group (a spawn of the ranks costs seconds)."""
    # CPU ranks over gloo even where a GPU is visible (several ranks cannot share one GPU over gloo)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        for shard in shards:
            found = {}
            sharded_matches_unsharded(shard, found, rank)
            pushed_weights_land_in_the_shards(shard)
            if directory:
                hf_model_read_in_slices(rank, shard, directory, found)
            found[(rank, "done")] = True
            results[(shard, rank)] = found
    finally:
        dist.destroy_process_group()


def hf_model_read_in_slices(rank: int, shard: int, directory: str, results: dict) -> None:
    from rldsl.models import load_model

    source = f"hf:{directory}"
    read = read_bytes_counted()
    engine = FsdpLogprob(loading.meta_hf_model(source), shard=shard, rows_per_forward=4)
    results[(rank, "read")] = sum(read)
    pretrained = load_model(source)
    batch = make_batch(pretrained)
    with torch.no_grad():
        expected = response_logprobs(pretrained, batch)
    results[(rank, "hf error")] = float((engine.logprobs(batch) - expected).abs().max())


def run_ranks(world_size: int, shards: int | tuple[int, ...], directory="") -> dict:
    """The ranks' results; for several ``shards`` (layouts run one after another) a dict per layout."""
    layouts = shards if isinstance(shards, tuple) else (shards,)
    results = start_ranks(_worker, (world_size, layouts, free_port(), str(directory)), nprocs=world_size)
    per_layout = {shard: {key: value for rank in range(world_size) for key, value in
                          results.get((shard, rank), {}).items()} for shard in layouts}
    return per_layout if isinstance(shards, tuple) else per_layout[shards]


def assert_sharded(results: dict, world_size: int, copy_ranks: int) -> None:
    assert all(results.get((rank, "done")) for rank in range(world_size)), results
    errors = [value for key, value in results.items() if len(key) == 3 and key[1] == "error"]
    assert errors and max(errors) < 1e-6, results
    for options in ({"rows_per_forward": 2}, {"tokens_per_forward": 12}, {}):
        forwards = {results[(rank, "forwards", str(options))] for rank in range(world_size)}
        assert len(forwards) == 1, (options, results)  # every rank ran as many forwards (padded)
    full, held = results["full"], [results[(rank, "held")] for rank in range(world_size)]
    assert sum(held) == world_size // copy_ranks * full, results  # each copy's shards tile the model once
    assert all(0.9 * full / copy_ranks <= bytes_ <= 1.1 * full / copy_ranks for bytes_ in held), results


def test_two_ranks_shard_the_model_and_match_the_unsharded_logprobs(tmp_path):
    from tests.hf_tiny import save_char_llama

    path = save_char_llama(tmp_path / "llama")
    results = run_ranks(2, 0, path)
    assert_sharded(results, 2, 2)
    assert max(results[(rank, "hf error")] for rank in (0, 1)) < 1e-5, results
    from safetensors.torch import load_file

    total = sum(t.numel() * t.element_size() for t in load_file(os.path.join(path, "model.safetensors")).values())
    assert all(abs(results[(rank, "read")] - total / 2) < 0.05 * total for rank in (0, 1)), results


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    """Four ranks spawned once for both four-rank layouts: full shard (0) and two ranks per copy (2)."""
    return run_ranks(4, (0, 2))


def test_four_ranks_full_shard(four_ranks):
    assert_sharded(four_ranks[0], 4, 4)


def test_four_ranks_hybrid_two_per_copy(four_ranks):
    assert_sharded(four_ranks[2], 4, 2)


def test_shard_one_keeps_the_whole_model_per_rank():
    model = make_model()
    batch = make_batch(model)
    engine = FsdpLogprob(copy.deepcopy(model), shard=1, rows_per_forward=3)
    assert engine.mesh is None
    held, full = parameter_bytes(engine.model.module)
    assert held == full
    with torch.no_grad():
        assert torch.allclose(engine.logprobs(batch), response_logprobs(model, batch), atol=1e-6)


def test_a_sharded_stage_serves_each_call_with_its_whole_shard_group():
    """The plan's `shard` makes the replicas the controller sends calls to:
    each shard group, or each rank for a whole copy per rank."""
    from rldsl.runtime.engines.factory import logprob_copy_ranks
    from rldsl.runtime.ray_lowering.controller_actor import _replicas
    from tests.test_resident_memory import compiled

    for engine, copy_ranks, replicas in (("fsdp(dtype = bf16)", 1, [[r] for r in range(8)]),
                                         ("fsdp(shard = 0, dtype = bf16)", 8, [list(range(8))]),
                                         ("fsdp(shard = 4, dtype = bf16)", 4, [[0, 1, 2, 3], [4, 5, 6, 7]])):
        result = compiled(engine)
        stage = next(s for s in result.plan.pipelines[0].stages if s.name == "reference")
        assert logprob_copy_ranks(stage) == copy_ranks and _replicas(stage) == replicas, engine
