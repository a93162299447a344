"""What the engine factory reads from a train stage's plan: the loss, the
optimizer and its schedule, the forward sizes; older plans still build."""

from dataclasses import replace
from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.runtime.engines.factory import build_trainer, loss_options, training_options
from rldsl.runtime.engines.policy_loss import PolicyLossConfig
from rldsl.runtime.engines.schedule import LRSchedule

PIPELINE = Path(__file__).parent.parent / "pipelines" / "grpo_async.rlp"
TRAINING = """
  global_batch = 32
  micro_batch_tokens = 96
  loss = grpo(clip = 0.2, clip_high = 0.28, kl = 0.01, kl_estimator = k2, agg = seq_mean_token_sum)
  lr_schedule = cosine
  warmup = 3
  min_lr = 1e-5
  lr = 5e-4
"""


def planned(training: str = TRAINING):
    text = PIPELINE.read_text().replace("  loss = grpo(clip = 0.2, kl = 0.001, agg = token_mean)\n", "")
    text = text.replace("  lr = 5e-4\n", training)
    result = compile_source(text, str(PIPELINE), base_dir=PIPELINE.parent)
    assert result.ok, [d.message for d in result.diagnostics if d.is_error]
    pipe = result.plan.pipelines[0]
    return pipe, next(stage for stage in pipe.stages if stage.kind == "train")


def test_a_train_stage_gives_the_trainer_options():
    pipe, stage = planned()
    options = training_options(stage, pipe)
    assert PolicyLossConfig(**options["loss"]) == PolicyLossConfig(clip=0.2, clip_high=0.28, kl=0.01,
                                                                   kl_estimator="k2", agg="seq_mean_token_sum")
    assert options["tokens_per_forward"] == 96 and options["rows_per_forward"] == 8
    assert options["lr"] == 5e-4 and options["max_grad_norm"] == 1.0
    # 40 rollout batches x (16 prompts x 8 samples // 32 = 4 mini-batches) x 1 epoch
    assert options["lr_schedule"] == LRSchedule("cosine", warmup=3, total=160, min_lr=1e-5)


def test_an_older_plan_without_the_new_keys_still_builds():
    pipe, stage = planned("  lr = 5e-4\n  loss = grpo(kl = 0.001)\n")
    old = {key: value for key, value in stage.settings.items()
           if key not in ("lr_schedule", "warmup", "min_lr", "ppo_epochs", "micro_batch_tokens")}
    old["loss"] = {"name": "grpo", "clip": 0.2, "kl": 0.0, "level": "sequence"}
    stage = replace(stage, settings=old, engine=replace(stage.engine, name="sim", args={}))
    options = training_options(stage, pipe)
    assert options["loss"] == {"clip": 0.2, "kl": 0.0, "agg": "seq_mean_token_mean"}
    assert options["lr_schedule"] == LRSchedule(total=40) and options["tokens_per_forward"] == 0  # constant
    trainer = build_trainer(stage, pipe, seed=0)
    assert trainer.base_lr == 5e-4 and trainer.lr_schedule == LRSchedule(total=40)


def test_legacy_loss_levels_map_to_aggregations():
    assert loss_options({"name": "grpo", "level": "token"}) == {"agg": "token_mean"}
    assert loss_options({"name": "grpo", "clip": 0.1}) == {"clip": 0.1}
    with pytest.raises(KeyError):
        loss_options({"level": "batch"})
