"""Mini-batches: ``optimizer_step`` inside an open rollout-batch step.

A rollout batch taken in several optimizer steps bumps the version once;
each optimizer step is the one a separate step over its mini-batch takes.
"""

import copy

import pytest
import torch

from rldsl.runtime.engines.sim import SimTrainer, SplitStepError
from rldsl.runtime.engines.torch import TorchTrainer
from tests.test_split_step_gradient import make_batch, make_model

MINI_BATCHES = [(0, 3), (3, 7), (7, 10)]


def rows(batch, start, stop):
    return {name: value[start:stop] for name, value in batch.items()}


def test_torch_trainer_takes_one_optimizer_step_per_mini_batch_and_one_version():
    model = make_model()
    batch = make_batch(model)
    trainer = TorchTrainer(copy.deepcopy(model), lr=1e-2)
    trainer.begin_train_step(0)
    losses = []
    for start, stop in MINI_BATCHES[:-1]:
        trainer.train_microbatch(0, rows(batch, start, stop))
        metrics = trainer.optimizer_step(0)
        losses.append(metrics["loss"])
        assert trainer.version == 0 and all(p.grad is None for p in trainer.parameters)
    trainer.train_microbatch(0, rows(batch, *MINI_BATCHES[-1]))
    result = trainer.finish_train_step(0)
    assert result.version == trainer.version == 1
    assert all(int(trainer.optimizer.state[p]["step"]) == 3 for p in trainer.parameters)  # three AdamW steps
    assert result.metrics["optimizer_steps"] == 3.0
    # Each optimizer step is what a separate rollout step over its mini-batch takes.
    separate = TorchTrainer(copy.deepcopy(model), lr=1e-2)
    separate_losses = []
    for step, (start, stop) in enumerate(MINI_BATCHES):
        separate.begin_train_step(step)
        separate.train_microbatch(step, rows(batch, start, stop))
        separate_losses.append(separate.finish_train_step(step).metrics["loss"])
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(trainer.parameters, separate.parameters))
    assert losses == separate_losses[:2]
    assert result.metrics["loss"] == pytest.approx(sum(separate_losses) / 3)  # the mean over the three


def test_a_mini_batch_without_tokens_is_skipped():
    model = make_model()
    batch = make_batch(model)
    trainer = TorchTrainer(model, lr=1e-2)
    trainer.begin_train_step(0)
    assert trainer.optimizer_step(0) == {"skipped": 1.0}  # nothing trained yet
    trainer.train_microbatch(0, batch)
    trainer.optimizer_step(0)
    result = trainer.finish_train_step(0)  # nothing since the last optimizer step: finish takes none
    assert result.version == 1 and result.metrics["optimizer_steps"] == 1.0
    assert all(int(trainer.optimizer.state[p]["step"]) == 1 for p in trainer.parameters)
    with pytest.raises(RuntimeError, match="without an open step"):
        trainer.optimizer_step(1)


def test_sim_trainer_enforces_the_protocol_for_optimizer_steps():
    trainer = SimTrainer()
    batch = {"response_mask": torch.ones(2, 3), "advantage": torch.zeros(2)}
    with pytest.raises(SplitStepError, match="no open step"):
        trainer.optimizer_step(0)
    trainer.begin_train_step(0)
    with pytest.raises(SplitStepError, match="open step is 0"):
        trainer.optimizer_step(1)
    assert trainer.optimizer_step(0) == {"skipped": 1.0}
    trainer.train_microbatch(0, batch)
    assert trainer.optimizer_step(0)["rows"] == 2.0
    trainer.train_microbatch(0, batch)
    result = trainer.finish_train_step(0)
    assert result.version == 1 and result.metrics["optimizer_steps"] == 2.0
    assert [call for call, _, _ in trainer.calls].count("optimizer_step") == 2  # refused calls are not recorded


def test_sim_trainer_optimizer_step_failures_are_injectable():
    trainer = SimTrainer(fail_on=[("optimizer_step", 0)])
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, {"response_mask": torch.ones(1, 2), "advantage": torch.zeros(1)})
    from rldsl.runtime.engines.sim import SimFailure

    with pytest.raises(SimFailure):
        trainer.optimizer_step(0)
    trainer.abort_train_step(0)
    assert trainer.version == 0 and trainer.open_step is None
