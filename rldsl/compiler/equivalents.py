"""How a pipeline's batch and staleness settings read in the other
frameworks' vocabularies, for `rldsl plan` (docs/language.md#equivalents).

Counting: a weight version is one rollout batch (`prompts_per_step` prompt
groups), however many optimizer steps (`global_batch`, `ppo_epochs`) it
takes; `max_lag` counts versions, as every framework below counts its
staleness in rollout batches or weight syncs. A synchronous pipeline
(`max_lag = 0`) prints no asynchronous setting.
"""

from __future__ import annotations

from rldsl.plan import PipelinePlan


def batch_equivalents(pipe: PipelinePlan) -> list[tuple[str, str]]:
    b = pipe.batch
    train = pipe.stage(b.train_stage).settings
    pps, spp, gb, epochs = b.prompts_per_step, b.samples_per_prompt, b.global_batch, b.ppo_epochs
    budget = int(train.get("micro_batch_tokens", 0))
    verl_micro = (f"use_dynamic_bsz = True, ppo_max_token_len_per_gpu = {budget}" if budget
                  else f"ppo_micro_batch_size_per_gpu = {b.micro_batch}")
    return [
        ("verl", f"data.train_batch_size = {pps}, rollout.n = {spp}, actor.ppo_mini_batch_size = {gb // spp}, "
                 f"ppo_epochs = {epochs}, {verl_micro}"),
        ("NeMo RL", f"num_prompts_per_step = {pps}, num_generations_per_prompt = {spp}, "
                    f"train_global_batch_size = {gb}, "
                    + (f"dynamic_batching.enabled = true, train_mb_tokens = {budget}" if budget
                       else f"train_micro_batch_size = {b.micro_batch}")
                    + (" (its optimizer steps once per rollout batch: ppo_epochs has no counterpart)"
                       if epochs > 1 else "")),
        ("OpenRLHF", f"rollout_batch_size = {pps}, n_samples_per_prompt = {spp}, train_batch_size = {gb}, "
                     f"micro_train_batch_size = {b.micro_batch}, max_epochs = {epochs}"),
        ("AReaL", f"train_dataset.batch_size = {pps}, gconfig.n_samples = {spp}, "
                  f"actor.ppo_n_minibatches = {b.minibatches}"),
        ("ROLL", f"rollout_batch_size = {pps}, num_return_sequences_in_group = {spp}, ppo_epochs = {epochs}"),
    ]


def staleness_equivalents(pipe: PipelinePlan) -> list[tuple[str, str]]:
    lag, ahead = pipe.staleness.max_lag, pipe.staleness.max_ahead
    if lag == 0:
        return [("all five", "their synchronous loop (no asynchronous setting)")]
    # a max_ahead below max_lag is verl's alone: the others bound the version span only
    finer = f" (max_ahead = {ahead:g} has no counterpart)" if ahead is not None and ahead < lag else ""
    return [
        ("AReaL", f"max_head_offpolicyness = {lag}{finer}"),
        ("NeMo RL", f"async_grpo.enabled = true, max_trajectory_age_steps = {lag}{finer}"),
        ("ROLL", f"async_generation_ratio = {lag}{finer}"),
        ("verl", "the one-step-off recipe" if lag == 1 and ahead is None else
         f"the fully async recipe, async_training.staleness_threshold = {lag if ahead is None else ahead:g}, "
         f"trigger_parameter_sync_step x require_batches x ppo_mini_batch_size = {pipe.batch.prompts_per_step}"),
        ("OpenRLHF", ("--async_train (one batch generated ahead)" if lag == 1 else
                      f"no counterpart: --async_train generates one batch ahead, not {lag}") + finer),
    ]
