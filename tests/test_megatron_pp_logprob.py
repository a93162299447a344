"""Pipeline-parallel megatron logprobs on CPU: two processes over gloo run
the forward-only pipeline schedule (pp = 2, tp = 1), and the last stage's
log-probabilities equal those of one process (pp = 1) with the same
weights; the first stage only relays activations and returns None."""

from __future__ import annotations


import pytest

from tests.ports import spawn_ranks
import torch

from tests.test_megatron_engine import PARALLEL_SHAPE, make_batch, random_hf_weights

pytestmark = [pytest.mark.megatron,
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# (rows_per_forward, tokens_per_forward): by rows with an uneven last chunk,
# and by a token budget (chunks of different response lengths, trimmed).
FORWARDS = [(4, 0), (4, 20)]


def _logprobs(shape, weights, batch, pp: int, forwards: tuple[int, int]):
    from megatron.core import parallel_state

    from rldsl.runtime.engines.megatron import model as megatron_model
    from rldsl.runtime.engines.megatron.logprob import MegatronLogprob

    megatron_model.ensure_model_parallel(1, pp, seed=0)
    try:
        rows, tokens = forwards
        engine = MegatronLogprob(shape, weights, pp=pp, dtype="fp32", rows_per_forward=rows,
                                 tokens_per_forward=tokens)
        return engine.logprobs(batch)
    finally:
        parallel_state.destroy_model_parallel()


def _worker(rank: int, port: int, results: dict):
    import torch.distributed as dist

    from rldsl.runtime.engines.megatron.cpu_compat import megatron_on_cpu

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shape = PARALLEL_SHAPE  # tied embeddings: the last stage's output layer is the embedding
    weights, batch = random_hf_weights(shape, seed=1), make_batch(shape)
    try:
        with megatron_on_cpu():
            for forwards in FORWARDS:
                results[("pp1", forwards, rank)] = _logprobs(shape, weights, batch, 1, forwards)
                results[("pp2", forwards, rank)] = _logprobs(shape, weights, batch, 2, forwards)
    finally:
        dist.destroy_process_group()



def test_pipeline_parallel_logprobs_equal_the_unsplit_model_on_the_last_stage_only():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'rldsl[gpu]')")
    results = spawn_ranks(_worker)
    mask = make_batch(PARALLEL_SHAPE)["response_mask"]
    for forwards in FORWARDS:
        expected = results[("pp1", forwards, 0)]
        assert torch.equal(expected, results[("pp1", forwards, 1)])
        assert results[("pp2", forwards, 0)] is None, "the first pipeline stage has no logits"
        actual = results[("pp2", forwards, 1)]
        assert actual.shape == expected.shape
        assert float((actual - expected).abs().max()) < 1e-5, forwards
        assert bool((actual[mask == 0] == 0).all()) and bool((actual[mask == 1] < 0).all())


class _StubEngine:
    """Every rank computes; the worker decides who writes."""

    version = 0

    def logprobs(self, batch):
        return torch.zeros(len(batch["response_ids"]), 3)


def test_only_the_last_pipeline_stage_first_tp_rank_of_each_replica_writes_and_reports(monkeypatch):
    from pathlib import Path

    from rldsl.compiler.driver import compile_source
    from rldsl.runtime.engines import factory
    from rldsl.runtime.ray_lowering import workers

    text = (Path(__file__).parent.parent / "pipelines" / "hybrid_groups.rlp").read_text()
    text = text.replace("engine = megatron(tp = 4, pp = 1, offload = true)",
                        "engine = megatron(tp = 4, pp = 2, offload = true)", 1)
    result = compile_source(text)
    assert result.ok, [d.message for d in result.diagnostics]
    pipe = result.plan.pipeline()
    stage = pipe.stage("behaviour")  # a policy stage: the writer reports its version
    assert (stage.tp, stage.pp, stage.dp) == (4, 2, 2)
    monkeypatch.setattr(factory, "build_logprob", lambda *args, **kwargs: _StubEngine())
    keys = ["g0/0", "g0/1"]
    writers, reporters = [], []
    for rank in stage.ranks:
        worker = workers.LogprobWorker(pipe, stage, rank.index, {"backend": "memory"})
        worker._get = lambda keys, fields: {"response_ids": torch.zeros(len(keys), 3, dtype=torch.long),
                                            "version": torch.zeros(len(keys), dtype=torch.long)}
        written = []
        worker._put = lambda keys, fields, written=written: written.append(fields)
        if worker.logprob(keys) is not None:
            reporters.append(rank.index)
        if written:
            writers.append(rank.index)
    expected = [r.index for r in stage.ranks if r.pp_rank == 1 and r.tp_rank == 0]
    assert writers == reporters == expected
    assert sorted(stage.ranks[i].dp_rank for i in expected) == [0, 1]  # once per data-parallel replica
