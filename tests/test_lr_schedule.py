"""Learning-rate schedules by hand, in the torch trainer (checkpoints included),
the sim trainer and megatron-core's scheduler."""

import math

import pytest
import torch

from rldsl.models.tiny import build_tiny_lm
from rldsl.runtime.engines.schedule import LRSchedule
from rldsl.runtime.engines.sim import SimTrainer
from rldsl.runtime.engines.torch import TorchTrainer
from tests.test_split_step_gradient import make_batch

COSINE = LRSchedule("cosine", warmup=2, total=10, min_lr=0.1)
LINEAR = LRSchedule("linear", warmup=2, total=10, min_lr=0.1)


@pytest.mark.parametrize(("schedule", "step", "lr"), [
    (COSINE, 0, 0.0),  # warmup from 0: 0 / 2
    (COSINE, 1, 0.5),  # 1 / 2
    (COSINE, 2, 1.0),  # warmup done, decay progress 0
    (COSINE, 4, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),  # progress 2/8: 0.8681980515
    (COSINE, 6, 0.55),  # progress 4/8: 0.1 + 0.9 * 0.5 * (1 + cos(pi / 2))
    (COSINE, 10, 0.1),  # the end of the run: min_lr
    (COSINE, 12, 0.1),  # past it: stays there
    (LINEAR, 4, 0.775),  # 0.1 + 0.9 * (1 - 2/8)
    (LINEAR, 6, 0.55),  # 0.1 + 0.9 * (1 - 4/8)
    (LINEAR, 10, 0.1),
    (LRSchedule("constant", warmup=4), 1, 0.5),  # base 2: 2 * 1/4
    (LRSchedule("constant", warmup=4), 4, 2.0),
    (LRSchedule("constant", warmup=4, min_lr=0.1), 100, 2.0),  # constant ignores min_lr
    (LRSchedule(), 0, 2.0),  # the default: no warmup, constant
])
def test_lr_by_hand(schedule, step, lr):
    base = 2.0 if schedule.kind == "constant" else 1.0
    assert schedule.lr_at(step, base) == pytest.approx(lr, abs=1e-9)


def test_a_run_shorter_than_its_warmup_only_warms_up():
    schedule = LRSchedule("cosine", warmup=5, total=3)
    assert [schedule.lr_at(k, 1.0) for k in range(3)] == pytest.approx([0.0, 0.2, 0.4])


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="expected one of"):
        LRSchedule("exponential")
    with pytest.raises(ValueError, match="min_lr"):
        LRSchedule("linear", total=10, min_lr=1.0).check_base_lr(0.5)


@pytest.mark.parametrize("schedule", [COSINE, LINEAR, LRSchedule("constant", warmup=3)], ids=lambda s: s.kind)
def test_megatron_core_scheduler_gives_the_same_curve(schedule):
    pytest.importorskip("megatron.core")
    from rldsl.runtime.engines.megatron.components import build_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, 1.0, 0.0, schedule)
    for step in range(13):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(schedule.lr_at(step, 1.0), abs=1e-12), step
        scheduler.step(increment=1)


def small_model(seed: int = 3):
    return build_tiny_lm(seed=seed, d_model=32, n_layers=2, n_heads=2, d_ff=64)


def train_step(trainer, step: int, batch) -> dict:
    trainer.begin_train_step(step)
    trainer.train_microbatch(step, batch)
    return trainer.finish_train_step(step).metrics


def test_torch_trainer_follows_the_schedule_and_resumes_it(tmp_path):
    batch = make_batch(small_model())
    trainer = TorchTrainer(small_model(), lr=1.0, lr_schedule=COSINE)
    assert [train_step(trainer, step, batch)["lr"] for step in range(3)] == pytest.approx([0.0, 0.5, 1.0])
    trainer.save_checkpoint(tmp_path)
    expected = train_step(trainer, 3, batch)
    resumed = TorchTrainer(small_model(seed=9), lr=1.0, lr_schedule=COSINE)
    resumed.load_checkpoint(tmp_path)
    assert resumed.optimizer_steps == 3
    assert train_step(resumed, 3, batch)["lr"] == expected["lr"] == pytest.approx(COSINE.lr_at(3, 1.0))
    for mine, theirs in zip(resumed.parameters, trainer.parameters):
        assert torch.equal(mine, theirs)


def test_sim_trainer_reports_the_schedule_and_checkpoints_it(tmp_path):
    trainer = SimTrainer(lr=1.0, lr_schedule=COSINE)
    batch = {"response_mask": torch.ones(2, 3), "advantage": torch.zeros(2)}
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, batch)
    assert trainer.optimizer_step(0)["lr"] == 0.0
    trainer.train_microbatch(0, batch)
    assert trainer.finish_train_step(0).metrics == {"rows": 2.0, "lr": 0.5, "optimizer_steps": 2.0}
    trainer.save_checkpoint(tmp_path)
    resumed = SimTrainer(lr=1.0, lr_schedule=COSINE)
    assert resumed.load_checkpoint(tmp_path) == 1 and resumed.optimizer_steps == 2
    resumed.begin_train_step(1)
    resumed.train_microbatch(1, batch)
    assert resumed.finish_train_step(1).metrics["lr"] == 1.0
