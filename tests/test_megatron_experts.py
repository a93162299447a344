"""A Qwen3-MoE on the megatron trainer, over gloo in two processes: expert
parallelism (each rank holds half of each layer's experts, tokens travel to
them and back) and tensor parallelism give the one-process gradients, and
the export gathers every expert back into the Hugging Face tensors. With a
loss that weighs tokens by the proximal policy and two optimizer steps, the
proximal pass's forwards run in lockstep too (uneven rows, both ways). On
four processes, expert parallelism under pipeline parallelism (pp = 2), and
whole experts (etp = 1) under tp = 2, whose checkpoint exports offline."""

import contextlib
import json

import pytest
import torch

from rldsl.runtime.engines.megatron import hf_weights as hmw
from rldsl.runtime.engines.policy_loss import PolicyLossConfig
from tests.ports import spawn_ranks
from tests.test_megatron_engine import QWEN3_MOE, make_batch, reference_gradients, reference_logprobs

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

LAYOUTS = [(1, 2), (2, 1)]  # (tp, ep)
PIPELINED_LAYOUTS = [(1, 2, 2, None), (2, 2, 1, None), (2, 1, 2, 1)]  # (tp, pp, ep, etp) on four ranks
LOSS = PolicyLossConfig(kl=0.05)
DP2_ROWS = {0: [(0, 3), (3, 7)], 1: [(7, 10)]}  # uneven: rank 1 holds fewer rows
# weights exp(proximal - behaviour), untruncated: the gradient shows any wrong proximal logprob
PROXIMAL_LOSS = PolicyLossConfig(kl=0.05, correction="is")
# two mini-batches per rank: 3 forwards against 1 in the first (training), 1 against 2 in the second (proximal)
MINIBATCHES = {0: ([(0, 3), (3, 5)], [(5, 6)]), 1: ([(6, 7)], [(7, 9), (9, 10)])}
SECOND_MINIBATCH = [5, 7, 8, 9]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    path = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE)).save_pretrained(path)
    return path


@contextlib.contextmanager
def _ranks_on_cpu(rank: int, port: int, world_size: int):
    """This process as one of ``world_size`` gloo ranks with megatron's CPU shim."""
    import torch.distributed as dist

    from rldsl.runtime.engines.megatron.cpu_compat import megatron_on_cpu

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        with megatron_on_cpu():
            yield
    finally:
        dist.destroy_process_group()


def _one_step(path: str, batch: dict, rows: list, checkpoint: str | None = None, **layout) -> tuple[dict, dict]:
    """A step over this rank's ``rows``: its gradients (by Hugging Face name) and the export (and a
    checkpoint in ``checkpoint``)."""
    from rldsl.runtime.engines.megatron import model as mm
    from rldsl.runtime.engines.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer.from_pretrained(path, **layout, dtype="fp32", distributed_optimizer=False, lr=0.0,
                                              max_grad_norm=None, loss=LOSS, rows_per_forward=2)
    trainer.begin_train_step(0)
    for start, stop in rows:
        trainer.train_microbatch(0, {k: v[start:stop] for k, v in batch.items()})
    trainer.finish_train_step(0)
    if checkpoint:
        trainer.save_checkpoint(checkpoint)
    module = trainer.model.module
    names = dict(zip((n for n, _ in module.named_parameters()), mm.local_weights(module, trainer.shape)))
    grads = {names[n]: p.main_grad.clone() for n, p in module.named_parameters()}
    return grads, {n: t for bucket in trainer.weight_buckets(4096) for n, t in bucket.items()}


def _logprobs(path: str, batch: dict, rows: list, **layout) -> tuple[int, torch.Tensor | None]:
    """A logprob stage's call on this rank's rows (None off the last pipeline stage), and their first row."""
    from rldsl.runtime.engines.megatron.logprob import MegatronLogprob

    logprob = MegatronLogprob.from_pretrained(path, **layout, dtype="fp32", rows_per_forward=2)
    if layout.get("etp"):  # the weights again as a push brings them: each expert split over its own ranks
        from rldsl.runtime.engines.megatron import model as mm

        logprob.update_weights(mm.read_hf_weights(path), version=1, last=True)
    first, last = rows[0][0], rows[-1][1]
    return first, logprob.logprobs({k: v[first:last] for k, v in batch.items()})


def _two_minibatches_with_a_proximal_loss(path: str, batch: dict, pp: int = 1) -> dict:
    """The second mini-batch's gradients (lr 0: the weights stay those of the batch's start)."""
    from megatron.core import parallel_state

    from rldsl.runtime.engines.megatron import model as mm
    from rldsl.runtime.engines.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer.from_pretrained(path, pp=pp, ep=2, dtype="fp32", distributed_optimizer=False, lr=0.0,
                                              max_grad_norm=None, loss=PROXIMAL_LOSS, rows_per_forward=2)
    trainer.begin_train_step(0)
    first, second = MINIBATCHES[parallel_state.get_data_parallel_rank()]
    for rows in (first, second):
        for start, stop in rows:
            trainer.train_microbatch(0, {k: v[start:stop] for k, v in batch.items()})
        if rows is first:
            assert trainer.optimizer_step(0) == {"deferred": 1.0}  # held: the proximal pass runs for the second
    assert trainer.finish_train_step(0).version == 1
    module = trainer.model.module
    names = dict(zip((n for n, _ in module.named_parameters()), mm.local_weights(module, trainer.shape)))
    return {names[n]: p.main_grad.clone() for n, p in module.named_parameters()}


def _worker(rank: int, port: int, path: str, results: dict):
    from megatron.core import parallel_state

    from rldsl.runtime.engines.megatron import model as mm
    from rldsl.runtime.engines.megatron.model import ensure_model_parallel

    batch = make_batch(hmw.LlamaShape.from_hf_config(mm.read_hf_config(path)))
    with _ranks_on_cpu(rank, port, 2):
        for tp, ep in LAYOUTS:
            ensure_model_parallel(tp, 1, 0, ep)  # the groups first: this rank's rows follow its data-parallel place
            dp = parallel_state.get_data_parallel_world_size()
            rows = DP2_ROWS[parallel_state.get_data_parallel_rank()] if dp == 2 else [(0, 4), (4, 10)]
            grads, exported = _one_step(path, batch, rows, tp=tp, ep=ep)
            results[(tp, ep, rank)] = (parallel_state.get_tensor_model_parallel_rank(), grads, exported)
            # this rank's rows: 4 forwards on rank 0, 2 on rank 1
            results[("logprobs", tp, ep, rank)] = _logprobs(path, batch, rows, tp=tp, ep=ep)
            if ep == 2:
                results[("proximal", rank)] = _two_minibatches_with_a_proximal_loss(path, batch)
            parallel_state.destroy_model_parallel()


def test_expert_and_tensor_parallel_gradients_and_export_on_two_ranks(megatron, qwen3_moe):
    shape = hmw.LlamaShape.from_hf_config(json.loads((qwen3_moe / "config.json").read_text()))
    weights, batch = megatron.read_hf_weights(qwen3_moe), make_batch(shape)
    expected = reference_gradients(megatron, shape, weights, batch, LOSS)
    logprobs = reference_logprobs(megatron, shape, weights, batch)
    results = spawn_ranks(_worker, str(qwen3_moe))
    scale = max(float(g.abs().max()) for g in expected.values())
    for tp, ep in LAYOUTS:
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for rank in range(2):
            tp_rank, grads, exported = results[(tp, ep, rank)]
            for name, grad in grads.items():
                shards.setdefault(name, {})[tp_rank] = grad
            if tp_rank == 0:  # the first tensor-parallel rank exports the whole model (with ep: every expert)
                assert exported.keys() == weights.keys() and all(torch.equal(exported[n], weights[n])
                                                                  for n in weights)
        merged = {n: hmw.merge_tensor_parallel(n, [s[r] for r in sorted(s)]) for n, s in shards.items()}
        assert merged.keys() == expected.keys(), (tp, ep)
        worst = max(float((merged[n] - expected[n]).abs().max()) for n in expected) / scale
        assert worst < 1e-5, (tp, ep, worst)
        for rank in range(2):  # a logprob stage's forwards in lockstep too, rows uneven over the ranks
            first, values = results[("logprobs", tp, ep, rank)]
            assert torch.allclose(values, logprobs[first:first + len(values)], atol=1e-5)
        if ep == 2:  # each rank trained only its own half of the experts
            local = {n for n in results[(tp, ep, 0)][1] if hmw.is_expert_weight(n)}
            assert local and all(".local_experts.0." in n or ".local_experts.1." in n for n in local)
    assert_second_minibatch_gradients(megatron, shape, weights, batch, [results[("proximal", r)] for r in range(2)])


def assert_second_minibatch_gradients(megatron, shape, weights, batch, per_rank: list[dict]) -> None:
    """The ranks' gradients after two mini-batches with a proximal loss (each rank's experts and stage; the rest
    all-reduced) against one process's over the second mini-batch's rows."""
    second = {k: v[SECOND_MINIBATCH] for k, v in batch.items()}
    expected = reference_gradients(megatron, shape, weights, second, PROXIMAL_LOSS)
    merged = {name: grad for grads in per_rank for name, grad in grads.items()}
    assert merged.keys() == expected.keys()
    scale = max(float(g.abs().max()) for g in expected.values())
    worst = max(float((merged[n] - expected[n]).abs().max()) for n in expected) / scale
    assert worst < 1e-5, worst


def _pipelined_worker(rank: int, port: int, path: str, checkpoints: str, results: dict):
    """Each of ``PIPELINED_LAYOUTS`` on four ranks: a step, its export, a logprob call (and with ep under pp two
    mini-batches with a proximal loss; with etp a checkpoint under ``checkpoints``)."""
    from megatron.core import parallel_state

    from rldsl.runtime.engines.megatron import model as mm
    from rldsl.runtime.engines.megatron.model import ensure_model_parallel

    batch = make_batch(hmw.LlamaShape.from_hf_config(mm.read_hf_config(path)))
    with _ranks_on_cpu(rank, port, 4):
        for tp, pp, ep, etp in PIPELINED_LAYOUTS:
            ensure_model_parallel(tp, pp, 0, ep, etp)
            dp = parallel_state.get_data_parallel_world_size()
            rows = DP2_ROWS[parallel_state.get_data_parallel_rank()] if dp == 2 else [(0, 4), (4, 10)]
            layout = {"tp": tp, "pp": pp, "ep": ep, "etp": etp}
            places = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_tensor_parallel_rank())
            step = _one_step(path, batch, rows, checkpoints if etp else None, **layout)
            results[(tp, pp, ep, rank)] = (places, *step, *_logprobs(path, batch, rows, **layout))
            if ep == 2 and pp == 2:
                results[("proximal", rank)] = _two_minibatches_with_a_proximal_loss(path, batch, pp=pp)
            parallel_state.destroy_model_parallel()


def test_experts_under_pipeline_parallelism_on_four_ranks(megatron, qwen3_moe, tmp_path):
    """pp = 2 with ep = 2 (two replicas, rows uneven over them), with tp = 2 (sequence parallel between the
    stages), and ep = 2 with whole experts (etp = 1) under tp = 2: the one-process gradients, every expert exported,
    a logprob stage's logprobs; with ep the forwards in lockstep with the stage's other replica, the proximal pass's
    too; with etp = 1 the checkpoint's offline export gives the model's tensors."""
    from rldsl.runtime.engines.megatron.hf_export import checkpoint_to_hf

    shape = hmw.LlamaShape.from_hf_config(json.loads((qwen3_moe / "config.json").read_text()))
    weights, batch = megatron.read_hf_weights(qwen3_moe), make_batch(shape)
    expected = reference_gradients(megatron, shape, weights, batch, LOSS)
    logprobs = reference_logprobs(megatron, shape, weights, batch)
    results = spawn_ranks(_pipelined_worker, str(qwen3_moe), str(tmp_path), nprocs=4)
    scale = max(float(g.abs().max()) for g in expected.values())
    for tp, pp, ep, etp in PIPELINED_LAYOUTS:
        ranks = [results[(tp, pp, ep, rank)] for rank in range(4)]
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for (tp_rank, etp_rank), grads, *_ in ranks:  # an expert's shards are over its etp ranks
            for name, grad in grads.items():
                shards.setdefault(name, {})[etp_rank if hmw.is_expert_weight(name) else tp_rank] = grad
        merged = {n: hmw.merge_tensor_parallel(n, [s[r] for r in sorted(s)]) for n, s in shards.items()}
        assert merged.keys() == expected.keys(), (tp, pp, ep)
        worst = max(float((merged[n] - expected[n]).abs().max()) for n in expected) / scale
        assert worst < 1e-5, (tp, pp, ep, worst)
        exported = ranks[0][2]  # the first stage's first rank exports the whole model
        assert exported.keys() == weights.keys() and all(torch.equal(exported[n], weights[n]) for n in weights)
        scored = [(first, values) for *_, first, values in ranks if values is not None]  # the last stage's ranks
        assert len(scored) == 4 // pp, (tp, pp, ep)
        for first, values in scored:
            assert torch.allclose(values, logprobs[first:first + len(values)], atol=1e-5), (tp, pp, ep)
    exported = checkpoint_to_hf(tmp_path, shape)  # lr 0: the weights loaded
    assert exported.keys() == weights.keys() and all(torch.equal(exported[n], weights[n]) for n in weights)
    assert_second_minibatch_gradients(megatron, shape, weights, batch, [results[("proximal", r)] for r in range(4)])
