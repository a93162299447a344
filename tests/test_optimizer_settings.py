"""The train stage's optimizer and KL settings from the .rlp file to the
engines: Adam's betas and epsilon, the warmup's start, the KL clamps, and
the reward and advantage clips the controller applies."""

from __future__ import annotations

import pytest
import torch

from rldsl.compiler.driver import compile_source
from rldsl.models.tiny import build_tiny_lm
from rldsl.runtime.control.settings import settings_from_plan
from rldsl.runtime.engines.factory import training_options
from rldsl.runtime.engines.policy_loss import PolicyLossConfig, kl_estimate, policy_loss
from rldsl.runtime.engines.schedule import LRSchedule
from rldsl.runtime.engines.torch.train import TorchTrainer
from tests import test_fsdp_engine
from tests.test_megatron_engine import SHAPES, make_trainer, random_hf_weights
from tests.test_training_keys import BASE, TRAIN, compiled


def trainer_from(train: str) -> TorchTrainer:
    pipe = compiled(train).plan.pipeline()
    return TorchTrainer(build_tiny_lm(seed=0, d_model=16, n_layers=1, n_heads=2, d_ff=32),
                        **training_options(pipe.stage("actor"), pipe))


def adam_of(optimizer) -> tuple:
    group = optimizer.param_groups[0]
    return tuple(group["betas"]), group["eps"]


def test_adam_betas_and_eps_reach_the_torch_trainer():
    assert adam_of(trainer_from("  adam_betas = [0.9, 0.95]\n  adam_eps = 1e-6").optimizer) == ((0.9, 0.95), 1e-6)


def test_without_the_keys_each_engine_keeps_its_own_betas():
    pipe = compiled().plan.pipeline()
    assert "adam_betas" not in pipe.stage("actor").settings
    assert adam_of(trainer_from("").optimizer) == ((0.9, 0.99), 1e-8)


def test_adam_betas_and_eps_reach_the_fsdp_trainer(one_process_group):
    from rldsl.runtime.engines.fsdp import FsdpTrainer

    pipe = compiled("  adam_betas = [0.8, 0.95]\n  adam_eps = 1e-5").plan.pipeline()
    trainer = FsdpTrainer(test_fsdp_engine.make_model(), **training_options(pipe.stage("actor"), pipe))
    assert adam_of(trainer.optimizer) == ((0.8, 0.95), 1e-5)
    assert adam_of(FsdpTrainer(test_fsdp_engine.make_model()).optimizer) == ((0.9, 0.99), 1e-8)


@pytest.mark.megatron
def test_adam_betas_and_eps_reach_the_megatron_optimizer(megatron):
    from rldsl.runtime.engines.megatron.state import _inner_optimizers

    shape = SHAPES["qwen2"]
    tuned = make_trainer(shape, random_hf_weights(shape), betas=(0.8, 0.95), eps=1e-5)
    assert {adam_of(inner) for inner in _inner_optimizers(tuned.optimizer)} == {((0.8, 0.95), 1e-5)}
    default = make_trainer(shape, random_hf_weights(shape))
    assert {adam_of(inner) for inner in _inner_optimizers(default.optimizer)} == {((0.9, 0.999), 1e-8)}


def test_warmup_starts_from_warmup_start_lr():
    schedule = LRSchedule("constant", warmup=4, warmup_start_lr=0.2)
    assert [schedule.lr_at(k, 1.0) for k in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    pipe = compiled("  lr = 1e-5\n  warmup = 2\n  warmup_start_lr = 1e-6").plan.pipeline()
    assert training_options(pipe.stage("actor"), pipe)["lr_schedule"].lr_at(1, 1e-5) == pytest.approx(5.5e-6)


def test_megatron_scheduler_warms_up_from_the_same_start():
    pytest.importorskip("megatron.core")
    from rldsl.runtime.engines.megatron.components import build_scheduler

    schedule = LRSchedule("cosine", warmup=3, total=10, min_lr=0.1, warmup_start_lr=0.25)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, 1.0, 0.0, schedule)
    for step in range(12):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(schedule.lr_at(step, 1.0), abs=1e-12), step
        scheduler.step(increment=1)


def test_kl_clamps_bound_the_log_ratio_then_the_estimate():
    policy, reference = torch.tensor([-9.0, -1.0]), torch.tensor([-1.0, -1.5])  # d = -8, 0.5
    assert kl_estimate(policy, reference, "k3").tolist() == pytest.approx([2980.957987 - 9, 0.10653066])
    assert kl_estimate(policy, reference, "k3", input_clamp=2.0).tolist() == \
        pytest.approx([7.389056 - 3, 0.10653066])  # e^2 - 2 - 1
    assert kl_estimate(policy, reference, "k1", output_clamp=0.25).tolist() == pytest.approx([-0.25, 0.25])


def test_kl_clamps_change_the_loss():
    logprobs = torch.tensor([[-9.0, -1.0]], requires_grad=True)
    fields = dict(behaviour_logprobs=logprobs.detach(), advantages=torch.zeros(1), mask=torch.ones(1, 2),
                  ref_logprobs=torch.tensor([[-1.0, -1.5]]))
    plain = policy_loss(logprobs, config=PolicyLossConfig(kl=1.0), **fields)
    clamped = policy_loss(logprobs, config=PolicyLossConfig(kl=1.0, kl_output_clamp=10.0), **fields)
    assert float(plain.loss_sum.detach()) == pytest.approx(2980.957987 - 9 + 0.10653066)
    assert float(clamped.loss_sum.detach()) == pytest.approx(10.0 + 0.10653066)
    with pytest.raises(ValueError, match="kl_input_clamp"):
        PolicyLossConfig(kl_input_clamp=-1.0)


def test_clamps_clips_and_leave_one_out_reach_the_plan_and_the_controller():
    pipe = compiled("  normalize = leave_one_out\n  reward_clip = 5\n  advantage_clip = 2.0\n"
                    "  loss = grpo(kl_input_clamp = 20, kl_output_clamp = 10)").plan.pipeline()
    loss = pipe.stage("actor").settings["loss"]
    assert (loss["kl_input_clamp"], loss["kl_output_clamp"]) == (20.0, 10.0)
    settings = settings_from_plan(pipe)
    assert (settings.normalize, settings.reward_clip, settings.advantage_clip) == ("leave_one_out", 5.0, 2.0)
    assert PolicyLossConfig(**training_options(pipe.stage("actor"), pipe)["loss"]).kl_clamps == \
        {"input_clamp": 20.0, "output_clamp": 10.0}


@pytest.mark.parametrize(("train", "message"), [
    ("  adam_betas = [0.9]", "adam_betas = [0.9]: Adam takes two betas"),
    ("  adam_betas = [0.9, 1.0]", "adam_betas = [0.9, 1]: Adam takes two betas"),
    ("  lr = 1e-6\n  warmup_start_lr = 1e-5", "warmup_start_lr = 1e-05 is above lr = 1e-06"),
])
def test_out_of_range_optimizer_settings_are_rlp312(train, message):
    result = compile_source(BASE.replace(TRAIN, f"  prompts_per_step = 8\n{train}\n}}"), "t.rlp")
    assert [d.code for d in result.diagnostics] == ["RLP312"]
    assert result.diagnostics[0].message.startswith(message)
