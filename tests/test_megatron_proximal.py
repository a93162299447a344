"""The megatron trainer's proximal pass, on CPU (megatron-core under the
test-only compat shim; fp32).

- with two optimizer steps per rollout batch, the later mini-batch trains
  against the logprobs of the batch-start weights (a separate logprob engine
  on the initial weights), though the weights moved at the first optimizer
  step; a second pass over the same rows (ppo_epochs) gets them again;
- with the weights held still (lr 0) those logprobs are exactly the
  trainer's own, so the gradients equal the path without a proximal pass;
  with one optimizer step per batch no proximal forward runs at all;
- an abort drops the held optimizer steps;
- tensor, pipeline and data parallel over gloo give the one-process weights.
"""

from __future__ import annotations

import pytest
import torch

from rldsl.runtime.engines.policy_loss import PolicyLossConfig
from tests import test_megatron_engine as engine_tests
from tests.ports import spawn_ranks
from tests.test_megatron_engine import PARALLEL_SHAPE, SHAPES, make_batch, make_trainer, random_hf_weights

pytestmark = [pytest.mark.megatron,
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

FIRST, SECOND = (0, 5), (5, 10)  # the rows of two mini-batches
# Adam divides by sqrt(v) + eps: a large eps keeps a near-zero gradient's rounding out of the step.
TRAINING = dict(lr=5e-2, eps=1e-2, rows_per_forward=2)
# Unclipped, w x ratio is pi / pi_behaviour whatever the proximal policy: a tight clip makes it count.
CLIP = 0.02


def rows(batch: dict, span: tuple[int, int]) -> dict:
    return {name: value[span[0]:span[1]] for name, value in batch.items()}


def batch_start_logprobs(shape, weights, batch) -> torch.Tensor:
    from rldsl.runtime.engines.megatron.logprob import MegatronLogprob

    return MegatronLogprob(shape, weights, dtype="fp32").logprobs(batch)


def record_losses(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every loss the trainer takes: (its logprobs, the proximal logprobs passed in)."""
    import rldsl.runtime.engines.megatron.trainer as trainer_module

    calls, real = [], trainer_module.policy_loss

    def recording(logprobs, *args):
        calls.append((logprobs.detach().clone(), None if args[-1] is None else args[-1].clone()))
        return real(logprobs, *args)

    monkeypatch.setattr(trainer_module, "policy_loss", recording)
    return calls


def parameters(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.module.named_parameters()}


def train_two_mini_batches(trainer, batch, later: tuple[int, int]):
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, rows(batch, FIRST))
    assert trainer.optimizer_step(0) == {"deferred": 1.0}
    start, stop = later
    for span in ((start, start + 2), (start + 2, stop)):  # the later mini-batch in two calls
        trainer.train_microbatch(0, rows(batch, span))
    return trainer.finish_train_step(0)


@pytest.mark.parametrize(("loss", "later"), [
    pytest.param({"correction": "tis", "clip": CLIP}, SECOND, id="tis-next-mini-batch"),
    pytest.param({"behaviour_cap": 3.0, "clip": CLIP}, FIRST, id="behaviour_cap-second-epoch"),  # ppo_epochs
])
def test_a_later_mini_batch_trains_against_the_batch_start_logprobs(megatron, monkeypatch, loss, later):
    from rldsl.runtime.engines.megatron.proximal import PROXIMAL

    shape = SHAPES["llama"]
    weights, batch = random_hf_weights(shape, seed=1), make_batch(shape)
    at_start = batch_start_logprobs(shape, weights, rows(batch, later))
    config = PolicyLossConfig(**loss)
    calls = record_losses(monkeypatch)
    trainer = make_trainer(shape, weights, loss=config, **TRAINING)
    result = train_two_mini_batches(trainer, batch, later)
    assert result.version == 1 and result.metrics["optimizer_steps"] == 2.0 and trainer.scheduler.num_steps == 2
    first_calls, later_calls = calls[:3], calls[3:]  # rows_per_forward = 2: 3 forwards of the first 5 rows
    assert all(proximal is None for _, proximal in first_calls)  # before any optimizer step: its own logprobs
    proximal = torch.cat([proximal for _, proximal in later_calls])
    trained_with = torch.cat([logprobs for logprobs, _ in later_calls])
    assert float((proximal - at_start).abs().max()) < 1e-6
    assert float((trained_with - at_start).abs().max()) > 1e-3  # the weights had moved
    assert result.metrics["clip_fraction"] > 0  # the later ratios, against the batch start, were clipped

    # The same as replaying it by hand: one step on the first rows, then the later rows against at_start.
    monkeypatch.undo()
    replay = make_trainer(shape, weights, loss=config, **TRAINING)
    replay.begin_train_step(0)
    replay.train_microbatch(0, rows(batch, FIRST))
    replay._take_optimizer_step()
    replay._zero_grads()
    replay.train_microbatch(0, {**rows(batch, later), PROXIMAL: at_start})
    replay.finish_train_step(0)
    expected, actual = parameters(replay), parameters(trainer)
    assert all(torch.allclose(actual[name], expected[name], atol=1e-6) for name in expected)


def test_with_still_weights_the_proximal_pass_gives_the_trainers_own_logprobs(megatron):
    """lr 0: the batch-start weights are those of every forward, so the later
    mini-batch's gradients equal the old path's (its own detached logprobs).
    By a token budget: forwards of trimmed rows keep logprobs of their width."""
    shape = SHAPES["qwen2"]
    weights, batch = random_hf_weights(shape, seed=1), make_batch(shape)
    config = PolicyLossConfig(correction="icepop", kl=0.05, clip=CLIP)
    still = dict(TRAINING, lr=0.0, rows_per_forward=None, tokens_per_forward=20)
    held = make_trainer(shape, weights, loss=config, **still)
    result = train_two_mini_batches(held, batch, SECOND)
    # Against the proximal logprobs every ratio is 1: none clipped, even at a clip of 0.02.
    assert result.metrics["mean_ratio"] == pytest.approx(1.0, abs=1e-6) and result.metrics["clip_fraction"] == 0
    alone = make_trainer(shape, weights, loss=config, **still)
    alone.begin_train_step(0)
    for span in ((5, 7), (7, 10)):
        alone.train_microbatch(0, rows(batch, span))
    alone.finish_train_step(0)
    for (name, mine), theirs in zip(held.model.module.named_parameters(), alone.model.module.parameters()):
        assert torch.allclose(mine.main_grad, theirs.main_grad, rtol=0, atol=1e-7), name


def test_one_optimizer_step_per_batch_runs_no_proximal_pass(megatron, monkeypatch):
    """The old path: the gradient is the full-batch one of the loss against the trainer's own logprobs."""
    from rldsl.runtime.engines.megatron.proximal import ProximalPass

    shape = SHAPES["llama"]
    weights, batch = random_hf_weights(shape, seed=1), make_batch(shape)
    config = PolicyLossConfig(correction="tis", correction_high=1.5, kl=0.05)
    expected = engine_tests.reference_gradients(megatron, shape, weights, batch, config)

    def refused(*args):
        raise AssertionError("a proximal pass with one optimizer step per rollout batch")

    monkeypatch.setattr(ProximalPass, "_proximal_logprobs", refused)
    trainer = make_trainer(shape, weights, loss=config, rows_per_forward=3)
    trainer.begin_train_step(0)
    for span in ((0, 4), (4, 10)):
        trainer.train_microbatch(0, rows(batch, span))
    assert trainer.finish_train_step(0).metrics["optimizer_steps"] == 1.0
    actual = {name: p.main_grad for name, p in trainer.model.module.named_parameters()}
    scale = max(float(g.abs().max()) for g in expected.values())
    assert max(float((actual[n] - expected[n]).abs().max()) for n in expected) / scale < 1e-5


def test_an_abort_drops_the_held_optimizer_steps(megatron):
    shape = SHAPES["llama"]
    weights, batch = random_hf_weights(shape, seed=1), make_batch(shape)
    trainer = make_trainer(shape, weights, loss=PolicyLossConfig(correction="tis"), **TRAINING)
    before = parameters(trainer)
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, rows(batch, FIRST))
    trainer.optimizer_step(0)
    assert trainer.train_microbatch(0, rows(batch, SECOND))["tokens"] == float(rows(batch, SECOND)
                                                                              ["response_mask"].sum())
    trainer.abort_train_step(0)
    assert trainer.version == 0 and trainer.scheduler.num_steps == 0
    assert all(torch.equal(p, before[n]) for n, p in parameters(trainer).items())
    trainer.begin_train_step(1)
    trainer.train_microbatch(1, batch)
    assert trainer.finish_train_step(1).metrics["optimizer_steps"] == 1.0


# -- tensor, pipeline and data parallel on two ranks ----------------------------------------------

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) on 2 ranks; tp = pp = 1 is dp = 2
DP2_ROWS = {0: [[(0, 3)], [(5, 6), (6, 8)]], 1: [[(3, 5)], [(8, 10)]]}  # per mini-batch; rank 0 has more calls
PARALLEL_LOSS = PolicyLossConfig(correction="mis", correction_high=3.0, clip=CLIP)


def _parallel_worker(rank: int, port: int, results: dict):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rldsl.runtime.engines.megatron import model as megatron_model
    from rldsl.runtime.engines.megatron.cpu_compat import megatron_on_cpu

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    weights, batch = random_hf_weights(PARALLEL_SHAPE, seed=1), make_batch(PARALLEL_SHAPE)
    try:
        with megatron_on_cpu():
            for tp, pp in LAYOUTS:
                megatron_model.ensure_model_parallel(tp, pp, seed=0)
                trainer = make_trainer(PARALLEL_SHAPE, weights, loss=PARALLEL_LOSS, tp=tp, pp=pp, **TRAINING)
                dp_rank = parallel_state.get_data_parallel_rank()
                mini_batches = DP2_ROWS[dp_rank] if tp * pp == 1 else [[FIRST], [(5, 7), (7, 10)]]
                trainer.begin_train_step(0)
                for index, calls in enumerate(mini_batches):
                    if index:
                        assert trainer.optimizer_step(0) == {"deferred": 1.0}
                    for span in calls:
                        trainer.train_microbatch(0, rows(batch, span))
                metrics = trainer.finish_train_step(0).metrics
                exported = {n: t for b in trainer.weight_buckets(1 << 20) for n, t in b.items()}
                results[(tp, pp, rank)] = (exported, metrics)
                parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def test_tensor_pipeline_and_data_parallel_proximal_pass_gives_the_one_process_weights(megatron):

    weights, batch = random_hf_weights(PARALLEL_SHAPE, seed=1), make_batch(PARALLEL_SHAPE)
    one = make_trainer(PARALLEL_SHAPE, weights, loss=PARALLEL_LOSS, **TRAINING)
    result = train_two_mini_batches(one, batch, SECOND)
    expected = {n: t for b in one.weight_buckets(1 << 20) for n, t in b.items()}
    assert result.metrics["clip_fraction"] > 0 and result.metrics["mean_ratio"] != pytest.approx(1.0, abs=1e-4)
    results = spawn_ranks(_parallel_worker)
    for tp, pp in LAYOUTS:
        exported, metrics = results[(tp, pp, 0)]  # the first rank of the replica exports
        assert exported.keys() == expected.keys()
        worst = max(float((exported[n] - expected[n]).abs().max()) for n in expected)
        assert worst < 1e-5, ((tp, pp), worst)
        assert metrics == results[(tp, pp, 1)][1]  # every rank reports the same global metrics
        for name in ("optimizer_steps", "loss", "mean_ratio", "clip_fraction"):
            assert metrics[name] == pytest.approx(result.metrics[name], abs=1e-6), ((tp, pp), name)
