"""Rollout corrections of the generator/trainer mismatch, and the proximal pass.

The loss values are worked out by hand on the inputs of test_policy_loss.py:
two sequences, the second with two real tokens, whose per-token weights
w = pi_prox / pi_behaviour (the proximal policy is the trainer's logprobs,
detached, when none is passed) are

    w   [[1.0, 1.5, 0.5], [0.7, 4.0, pad]]     advantages A = [+1, -2]

With a correction the ratio is taken against the proximal policy, so it is
1 and never clipped: each token's loss is -A w' with w' the corrected weight.
The sequence weights are the products: 0.75 and 2.8.
"""

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from rldsl.compiler.driver import compile_source
from rldsl.runtime.engines.policy_loss import PolicyLossConfig, policy_loss, rollout_metrics
from rldsl.runtime.engines.torch.common import response_logprobs
from rldsl.runtime.engines.torch.train import TorchTrainer
from tests.test_policy_loss import ADVANTAGES, BEHAVIOUR, LOGPROBS, MASK, loss
from tests.shared_runs import RLOO_STEPS
from tests.test_split_step_gradient import make_batch, make_model


def gradient(config: PolicyLossConfig) -> list[float]:
    logprobs = LOGPROBS.clone().requires_grad_(True)
    loss(config, logprobs).loss_sum.backward()
    return logprobs.grad.flatten().tolist()


# -- each correction against hand-computed values ------------------------------------------


@pytest.mark.parametrize(("options", "weights", "corrected"), [
    # tis, token: clamp at 2 -> [1, 1.5, 0.5], [0.7, 2.0]
    ({"correction": "tis"}, [1.0, 1.5, 0.5, 0.7, 2.0, 0.0], 1),
    # tis with a floor: clamp to [0.6, 2] -> 0.5 becomes 0.6
    ({"correction": "tis", "correction_low": 0.6}, [1.0, 1.5, 0.6, 0.7, 2.0, 0.0], 2),
    # mis, token: w outside [0, 2] dropped -> (2, 4.0) gone
    ({"correction": "mis"}, [1.0, 1.5, 0.5, 0.7, 0.0, 0.0], 1),
    # icepop: token mask at its defaults [0.5, 5]: all kept
    ({"correction": "icepop"}, [1.0, 1.5, 0.5, 0.7, 4.0, 0.0], 0),
    # icepop [0.8, 3]: 0.5, 0.7 and 4.0 dropped
    ({"correction": "icepop", "correction_low": 0.8, "correction_high": 3.0}, [1.0, 1.5, 0.0, 0.0, 0.0, 0.0], 3),
    # tis, sequence: products 0.75 and 2.8, the second clamped to 2, on every token of its sequence
    ({"correction": "tis", "correction_level": "sequence"}, [0.75, 0.75, 0.75, 2.0, 2.0, 0.0], 2),
    # mis, sequence: 2.8 > 2 drops the whole second sequence
    ({"correction": "mis", "correction_level": "sequence"}, [0.75, 0.75, 0.75, 0.0, 0.0, 0.0], 2),
    # behaviour_cap 2 is a token mask at [0, 2], as mis
    ({"behaviour_cap": 2.0}, [1.0, 1.5, 0.5, 0.7, 0.0, 0.0], 1),
    # is: the weight untruncated, 4.0 kept whole
    ({"correction": "is"}, [1.0, 1.5, 0.5, 0.7, 4.0, 0.0], 0),
    # is, sequence: the products 0.75 and 2.8, untouched
    ({"correction": "is", "correction_level": "sequence"}, [0.75, 0.75, 0.75, 2.8, 2.8, 0.0], 0),
])
def test_each_correction_weighs_tokens_as_computed_by_hand(options, weights, corrected):
    config = PolicyLossConfig(**options)
    out = loss(config)
    advantage_per_token = [1.0, 1.0, 1.0, -2.0, -2.0, 0.0]
    expected = sum(-a * w for a, w in zip(advantage_per_token, weights))
    assert out.loss_sum.item() == pytest.approx(expected, abs=1e-5) and out.count == 5  # dropped tokens count
    assert out.stats["capped_tokens"] == corrected
    assert out.stats["ratio_sum"] == pytest.approx(5.0, abs=1e-5)  # against the proximal policy: 1 each
    # d(-A w r)/d logp = -A w' (r = 1): the weight is a constant.
    assert gradient(config) == pytest.approx([-a * w for a, w in zip(advantage_per_token, weights)], abs=1e-5)


def test_the_tis_values_written_out():
    # -(1 + 1.5 + 0.5) + 2 (0.7 + 2.0) = 2.4
    assert loss(PolicyLossConfig(correction="tis")).loss_sum.item() == pytest.approx(2.4, abs=1e-5)
    # sequence: -3 x 0.75 + 2 x 2 x 2.0 = 5.75
    out = loss(PolicyLossConfig(correction="tis", correction_level="sequence"))
    assert out.loss_sum.item() == pytest.approx(5.75, abs=1e-5)


def test_the_untruncated_weight_written_out():
    # -(1 + 1.5 + 0.5) + 2 (0.7 + 4.0) = 6.4: the tis value 2.4 with the 4.0 no longer clamped to 2
    assert loss(PolicyLossConfig(correction="is")).loss_sum.item() == pytest.approx(6.4, abs=1e-5)


def test_the_untruncated_weight_drops_only_a_weight_that_overflowed():
    # The second sequence's last token: proximal 100 nats above behaviour, and e^100 overflows a float32.
    proximal = LOGPROBS.clone()
    proximal[1, 1] = BEHAVIOUR[1, 1] + 100
    out = policy_loss(LOGPROBS, BEHAVIOUR, ADVANTAGES, MASK, PolicyLossConfig(correction="is"),
                      proximal_logprobs=proximal)
    # That token's ratio to the proximal policy is e^-100, clipped up to 0.8: it would add 2 x 0.8 x inf.
    # Dropped (it still counts in N), the loss is the other tokens': ratio 1, weights [1, 1.5, 0.5], [0.7],
    # so -(1 + 1.5 + 0.5) + 2 x 0.7 = -1.6.
    assert out.loss_sum.item() == pytest.approx(-1.6, abs=1e-5) and out.count == 5
    assert out.stats["capped_tokens"] == 1


def test_without_a_correction_the_ratio_is_against_the_behaviour_policy():
    out = loss(PolicyLossConfig())
    assert out.loss_sum.item() == pytest.approx(6.9, abs=1e-5)  # test_policy_loss's clipped loss
    assert out.stats["capped_tokens"] == 0


def test_proximal_logprobs_passed_in_anchor_the_ratio_and_the_weight():
    # Proximal = behaviour + ln 2 on every token: w = 2 everywhere (kept by tis at 2),
    # ratio r = pi / pi_prox = the test_policy_loss ratios / 2: [0.5, 0.75, 0.25], [0.35, 2.0].
    proximal = (BEHAVIOUR + torch.log(torch.tensor(2.0))) * MASK
    out = policy_loss(LOGPROBS, BEHAVIOUR, ADVANTAGES, MASK, PolicyLossConfig(correction="tis"),
                      proximal_logprobs=proximal)
    # A = +1: max(-r, -clip(r)) = -r below the range: -0.5, -0.75, -0.25;
    # A = -2: max(2r, 2 clip(r)) = 1.6 (0.35 clipped up to 0.8), 4.0; times w = 2: 2 (-1.5 + 5.6) = 8.2
    assert out.loss_sum.item() == pytest.approx(8.2, abs=1e-5)
    assert out.stats["mismatch_ratio_sum"] == pytest.approx(10.0, abs=1e-5)
    assert (out.stats["mismatch_ratio_min"], out.stats["mismatch_ratio_max"]) == pytest.approx((2.0, 2.0))


def test_mismatch_statistics():
    # d = ln w: [0, ln 1.5, ln 0.5], [ln 0.7, ln 4]; k1 = -sum d = -ln(1.5 x 0.5 x 0.7 x 4) = -ln 2.1
    # k3 = sum(w - 1 - d) = (7.7 - 5) - ln 2.1
    out = loss(PolicyLossConfig())
    log_product = torch.log(torch.tensor(2.1)).item()
    assert out.stats["mismatch_kl_sum"] == pytest.approx(-log_product, abs=1e-5)
    assert out.stats["mismatch_k3_sum"] == pytest.approx(2.7 - log_product, abs=1e-5)
    assert out.stats["mismatch_ratio_sum"] == pytest.approx(7.7, abs=1e-5)
    assert (out.stats["mismatch_ratio_min"], out.stats["mismatch_ratio_max"]) == pytest.approx((0.5, 4.0))


def test_rollout_metrics_weigh_the_mismatch_by_tokens_and_keep_the_extremes():
    steps = [{"loss": 1.0, "tokens": 1.0, "mismatch_kl": 0.3, "mismatch_k3": 0.1, "mismatch_ratio_mean": 1.3,
              "capped_fraction": 0.0, "mismatch_ratio_max": 1.3, "mismatch_ratio_min": 1.3},
             {"loss": 3.0, "tokens": 3.0, "mismatch_kl": 0.1, "mismatch_k3": 0.05, "mismatch_ratio_mean": 0.9,
              "capped_fraction": 0.5, "mismatch_ratio_max": 1.1, "mismatch_ratio_min": 0.7}]
    metrics = rollout_metrics(steps)
    assert metrics["mismatch_kl"] == pytest.approx((0.3 + 0.3) / 4)
    assert metrics["mismatch_ratio_mean"] == pytest.approx((1.3 + 2.7) / 4)
    assert metrics["capped_fraction"] == pytest.approx(1.5 / 4)
    assert metrics["mismatch_ratio_max"] == 1.3 and metrics["mismatch_ratio_min"] == 0.7
    assert metrics["loss"] == 2.0 and metrics["optimizer_steps"] == 2.0


@pytest.mark.parametrize(("options", "message"), [
    ({"correction": "rejection"}, "correction"),
    ({"correction": "is", "correction_high": 5.0}, "untruncated"),
    ({"correction": "tis", "correction_level": "batch"}, "correction_level"),
    ({"correction": "icepop", "correction_level": "sequence"}, "icepop"),
    ({"correction": "tis", "correction_high": 0.9}, "correction bounds"),
    ({"correction": "mis", "correction_low": 1.2}, "correction bounds"),
    ({"correction": "tis", "behaviour_cap": 2.0}, "use one"),
])
def test_bad_correction_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**options)


# -- the proximal pass: two optimizer steps per rollout batch -------------------------------


def rows(batch, start, stop):
    return {name: value[start:stop] for name, value in batch.items()}


def recorded_trainer(model, monkeypatch, **loss):
    """A trainer whose every loss call records (logprobs, proximal logprobs passed in)."""
    import rldsl.runtime.engines.torch.train as train_module

    calls = []
    real = train_module.policy_loss

    def recording(logprobs, *args):
        calls.append((logprobs.detach().clone(), None if args[-1] is None else args[-1].clone()))
        return real(logprobs, *args)

    monkeypatch.setattr(train_module, "policy_loss", recording)
    return TorchTrainer(model, loss=PolicyLossConfig(**loss), lr=5e-2), calls


@pytest.mark.parametrize("loss_options", [{"correction": "tis"}, {"behaviour_cap": 3.0}])
def test_with_two_optimizer_steps_the_proximal_logprobs_are_the_batch_start_weights(monkeypatch, loss_options):
    model = make_model()
    batch = make_batch(model)
    first, second = rows(batch, 0, 5), rows(batch, 5, 10)
    with torch.no_grad():
        at_start = response_logprobs(model, second)
    trainer, calls = recorded_trainer(copy.deepcopy(model), monkeypatch, **loss_options)
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, first)
    assert trainer.optimizer_step(0) == {"deferred": 1.0}
    trainer.train_microbatch(0, second)
    result = trainer.finish_train_step(0)
    assert result.version == 1 and result.metrics["optimizer_steps"] == 2.0
    assert all(int(trainer.optimizer.state[p]["step"]) == 2 for p in trainer.parameters)
    # The second mini-batch trained after the first optimizer step, against the batch-start logprobs.
    (_, first_proximal), (after_step, second_proximal) = calls
    assert first_proximal is None  # before any optimizer step: the trainer's own logprobs
    assert torch.allclose(second_proximal, at_start, atol=1e-6)
    assert not torch.allclose(after_step, at_start, atol=1e-4)  # the weights had moved
    # The same as replaying it by hand: step on the first mini-batch, then the second against at_start.
    replay = TorchTrainer(copy.deepcopy(model), loss=PolicyLossConfig(**loss_options), lr=5e-2)
    replay.begin_train_step(0)
    replay.train_microbatch(0, first)
    replay._take_optimizer_step()
    replay._zero_grads()
    replay._forward_backward_sums(second, at_start)
    replay._sums["tokens"] = float(second["response_mask"].sum())
    replay._take_optimizer_step()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(trainer.parameters, replay.parameters))


def test_a_second_pass_reuses_the_batch_start_weights(monkeypatch):
    model = make_model()
    batch = make_batch(model)
    with torch.no_grad():
        at_start = response_logprobs(model, batch)
    trainer, calls = recorded_trainer(copy.deepcopy(model), monkeypatch, correction="mis", correction_high=5.0)
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, batch)  # ppo_epochs = 2: the same rows twice, an optimizer step between
    trainer.optimizer_step(0)
    trainer.train_microbatch(0, batch)
    result = trainer.finish_train_step(0)
    assert torch.allclose(calls[1][1], at_start, atol=1e-6)
    assert result.metrics["optimizer_steps"] == 2.0
    # Mismatch over both passes: the second pass's trainer and generator differ as the first's did.
    assert result.metrics["mismatch_ratio_min"] <= result.metrics["mismatch_ratio_mean"]
    assert result.metrics["mismatch_ratio_mean"] <= result.metrics["mismatch_ratio_max"]
    assert result.metrics["mismatch_k3"] > 0


def test_without_a_correction_optimizer_steps_are_taken_at_once(monkeypatch):
    model = make_model()
    batch = make_batch(model)
    trainer, calls = recorded_trainer(copy.deepcopy(model), monkeypatch)
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, rows(batch, 0, 5))
    assert "loss" in trainer.optimizer_step(0)
    assert all(int(trainer.optimizer.state[p]["step"]) == 1 for p in trainer.parameters)
    trainer.train_microbatch(0, rows(batch, 5, 10))
    trainer.finish_train_step(0)
    assert [proximal for _, proximal in calls] == [None, None]


def test_an_abort_drops_the_held_steps(monkeypatch):
    model = make_model()
    batch = make_batch(model)
    trainer, _ = recorded_trainer(copy.deepcopy(model), monkeypatch, correction="tis")
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, rows(batch, 0, 5))
    trainer.optimizer_step(0)
    trainer.train_microbatch(0, rows(batch, 5, 10))
    trainer.abort_train_step(0)
    assert trainer.version == 0 and not trainer.optimizer.state  # no step was taken
    trainer.begin_train_step(1)
    trainer.train_microbatch(1, batch)
    assert trainer.finish_train_step(1).metrics["optimizer_steps"] == 1.0


# -- the check ---------------------------------------------------------------------------------

BASE = (Path(__file__).parent / "golden" / "base.rlp").read_text()


def check(train_lines: str, generate_lines: str = "") -> list:
    text = BASE.replace("  prompts_per_step = 8\n", f"  prompts_per_step = 8\n{train_lines}\n")
    text = text.replace("  samples_per_prompt = 4\n", f"  samples_per_prompt = 4\n{generate_lines}\n")
    if "megatron" in train_lines:  # megatron loads a Hugging Face checkpoint (RLP112): the builtin model's GPT-2
        text = text.replace('source = "builtin:tiny-lm"', 'source = "builtin:tiny-gpt2"')
    return compile_source(text, "p.rlp").diagnostics


@pytest.mark.parametrize("engine", ["", "  engine = fsdp", "  engine = megatron(tp = 1)"])
@pytest.mark.parametrize("loss_line", ["  loss = grpo(correction = tis)", "  loss = grpo(behaviour_cap = 5.0)",
                                       "  loss = grpo(correction = mis, correction_level = sequence)"])
def test_several_optimizer_steps_with_a_proximal_pass_are_accepted(engine, loss_line):
    """Every trainer recomputes the proximal policy at the batch start (megatron: ``megatron/proximal.py``)."""
    assert check(f"{engine}\n  global_batch = 16\n  ppo_epochs = 2\n{loss_line}") == []


@pytest.mark.parametrize(("loss_line", "words"), [
    ("grpo(correction = tis, correction_high = 0.8)", "leave out the weight 1"),
    ("grpo(correction = mis, correction_low = 1.5, correction_high = 3.0)", "leave out the weight 1"),
    ("grpo(correction = icepop, correction_level = sequence)", "masks tokens"),
    ("grpo(correction = tis, behaviour_cap = 2.0)", "both weigh"),
    ("grpo(correction = is, correction_high = 5.0)", "untruncated"),
])
def test_bad_correction_arguments_are_reported(loss_line, words):
    found = check(f"  loss = {loss_line}")
    assert [d.code for d in found] == ["RLP312"] and words in found[0].message


def test_a_correction_without_behaviour_logprobs_is_an_error_with_a_fix():
    found = check("  loss = grpo(correction = tis)", "  logprobs = false")
    assert [d.code for d in found] == ["RLP204"]
    assert "correction = tis" in found[0].notes[0]
    assert found[0].help == "remove `logprobs = false` from `rollout`, or drop `correction = tis` from the loss"
    assert check("", "  logprobs = false")[0].code == "RLP204"  # max_lag = 1 needs them too, as before


# -- the step line and the report -------------------------------------------------------------

MISMATCH = {"mismatch_kl": 0.002, "mismatch_k3": 0.001, "mismatch_ratio_mean": 1.0, "mismatch_ratio_min": 0.8,
            "mismatch_ratio_max": 1.25, "capped_fraction": 0.125}


def test_the_step_line_and_the_report_show_the_mismatch(tmp_path):
    from rldsl.report.data import report_data
    from rldsl.runtime.ray_lowering.progress import _mismatch

    assert _mismatch(MISMATCH) == "kl 2.00e-03 ratio 0.80..1.25 corrected 12.5%"
    assert _mismatch({**MISMATCH, "capped_fraction": 0.0}) == "kl 2.00e-03 ratio 0.80..1.25"
    assert _mismatch({"loss": 1.0}) == ""  # a trainer without the figures (sim)
    steps = [{"step": s, "trainer": {**MISMATCH, "mismatch_kl": 0.001 * s}} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    curves = report_data(tmp_path).curves
    assert curves["generator/trainer mismatch: KL(behaviour || proximal)"].y == [0.001, 0.002]
    assert curves["generator/trainer mismatch: largest p_prox / p_behaviour"].y == [1.25, 1.25]
    assert curves["tokens truncated or masked by the correction (share)"].y == [0.125, 0.125]


# -- a real run ---------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.ray
def test_a_torch_run_with_tis_over_two_optimizer_steps_reports_the_mismatch(rloo_tis_run):
    records = [json.loads(line) for line in (rloo_tis_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    trainer = [r["trainer"] for r in records if "trainer" in r]
    assert len(trainer) == RLOO_STEPS and all(t["optimizer_steps"] == 2 for t in trainer)
    for metrics in trainer:
        assert metrics["mismatch_ratio_min"] <= metrics["mismatch_ratio_mean"] <= metrics["mismatch_ratio_max"]
        assert metrics["mismatch_k3"] >= 0 and 0 <= metrics["capped_fraction"] <= 1
    assert "mismatch kl" in rloo_tis_run.stderr  # the step line


# -- the fsdp trainer: the same proximal pass at its mini-batch boundaries ------------------------


def test_the_fsdp_trainer_takes_the_torch_trainers_steps(one_process_group):
    from rldsl.runtime.engines.fsdp import FsdpTrainer

    model = make_model()
    batch = make_batch(model)
    options = {"loss": PolicyLossConfig(correction="tis", correction_high=1.5), "lr": 5e-2}
    results = []
    for trainer in (TorchTrainer(copy.deepcopy(model), **options), FsdpTrainer(copy.deepcopy(model), **options)):
        trainer.begin_train_step(0)
        for start, stop in ((0, 3), (3, 7)):
            trainer.train_microbatch(0, rows(batch, start, stop))
            assert trainer.optimizer_step(0) == {"deferred": 1.0}
        trainer.train_microbatch(0, rows(batch, 7, 10))
        metrics = trainer.finish_train_step(0).metrics
        params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for p in trainer.parameters]
        results.append((metrics, params))
    (torch_metrics, torch_params), (fsdp_metrics, fsdp_params) = results
    assert fsdp_metrics["optimizer_steps"] == torch_metrics["optimizer_steps"] == 3.0
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(torch_params, fsdp_params))
    for name in ("loss", "mismatch_kl", "mismatch_ratio_max", "capped_fraction"):
        assert fsdp_metrics[name] == pytest.approx(torch_metrics[name], abs=1e-5)
    assert torch_metrics["capped_fraction"] > 0  # some weights above 1.5 were truncated


RANK_ROWS = {0: [[(0, 3)], [(5, 6), (6, 8)]], 1: [[(3, 5)], [(8, 10)]]}  # per mini-batch; uneven forwards
# A large Adam epsilon: a near-zero gradient's step would otherwise turn on its rounding (the ranks sum in
# another order than one process).
TWO_RANK_OPTIONS = {"loss": PolicyLossConfig(correction="mis"), "lr": 5e-2, "eps": 1e-2}


def _two_rank_worker(rank: int, world_size: int, shards: tuple[int, ...], port: int, directory: str, results: dict):
    """(test_fsdp_engine.run_ranks' worker protocol: this rank's results under ``(shard, rank)``.)"""
    import torch.distributed as dist

    from rldsl.runtime.engines.fsdp import FsdpTrainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        model = make_model()
        batch = make_batch(model)
        trainer = FsdpTrainer(copy.deepcopy(model), **TWO_RANK_OPTIONS)
        trainer.begin_train_step(0)
        for index, minibatch in enumerate(RANK_ROWS[rank]):
            if index:
                trainer.optimizer_step(0)
            for start, stop in minibatch:
                trainer.train_microbatch(0, rows(batch, start, stop))
        metrics = dict(trainer.finish_train_step(0).metrics)
        results[(shards[0], rank)] = {(rank, "metrics"): metrics,
                                      (rank, "params"): [p.full_tensor().detach().cpu() for p in trainer.parameters]}
    finally:
        dist.destroy_process_group()


def test_two_fsdp_ranks_with_uneven_microbatches_match_one_torch_trainer(tmp_path):
    from tests.test_fsdp_engine import run_ranks

    results = run_ranks(2, 0, tmp_path, worker=_two_rank_worker)
    model = make_model()
    batch = make_batch(model)
    reference = TorchTrainer(copy.deepcopy(model), **TWO_RANK_OPTIONS)
    reference.begin_train_step(0)
    reference.train_microbatch(0, rows(batch, 0, 5))
    reference.optimizer_step(0)
    reference.train_microbatch(0, rows(batch, 5, 10))
    expected = reference.finish_train_step(0).metrics
    for rank in (0, 1):
        assert all(torch.allclose(a, b.detach(), atol=1e-5) for a, b in zip(results[(rank, "params")],
                                                                             reference.parameters))
        assert results[(rank, "metrics")]["mismatch_ratio_max"] == pytest.approx(expected["mismatch_ratio_max"])
        assert results[(rank, "metrics")]["loss"] == pytest.approx(expected["loss"], abs=1e-5)
