"""What the controller's pumps need to know, and nothing else.

The runtime fills a ``RunSettings`` from the compiled ExecutionPlan; tests and
benchmarks build one by hand. Only local sanity is checked here (positive
sizes, known enum values): cross-field rules such as "the buffer holds at
least one step" are the compiler's job, and the controller's watchdog is the
safety net when a plan skips them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rldsl.plan import PipelinePlan, StalenessPlan, ahead_groups, receives_weights, recomputes_at_batch_start
from rldsl.runtime.control.advantages import ESTIMATORS, NORMALISATIONS, REWARD_CLIP_PLACES, STD_KINDS
from rldsl.runtime.protocols import MIB

Order = Literal["any", "in_order"]
TooStale = Literal["drop", "wait"]

_STALENESS = StalenessPlan()  # the language's defaults (rldsl.plan)


@dataclass(frozen=True)
class RunSettings:
    """Knobs of one run.

    Staleness vocabulary (DESIGN.md section 2): a sample's lag is the
    trainer's version when it is trained minus the weight version that
    generated it; ``max_lag = 0`` is on-policy.

    - ``order``: ``"any"`` trains whichever ready groups fit the bound
      (lowest lag first, then arrival); ``"in_order"`` assigns every prompt
      group a target step at dispatch, strictly in prompt order, and a step
      trains exactly its own groups.
    - ``too_stale``: a fresher group may take a slot only while every older
      ready group still fits a step within its bound. With ``"drop"`` the
      train pump never idles while a group is ready, and a group that expires
      anyway (it arrived too late) is dropped (ledger reason ``too_stale``);
      with ``"wait"`` groups still in flight are protected as well, so the
      train pump waits for them and nothing goes stale.
    - ``max_ahead``: prompt groups generated ahead of the trainer, in steps
      (verl's ``staleness_threshold``): at most ``ahead_groups`` groups
      generated before a version train at or after it. None: ``max_lag``
      steps, which the lag bound allows anyway.
    - ``buffer_capacity`` counts prompt groups that are reserved (dispatched),
      ready, or consumed by the open step; ``max_inflight`` counts groups
      dispatched but not yet ready. Both default to one staleness window,
      ``(max_lag + 1) * prompts_per_step``.
    - ``reward_stages`` / ``logprob_stages``: stage names, each in flow order.
      Rewards run first, so a group whose rewards all failed skips logprobs.
    - ``policy_logprob_stages``: the logprob stages that score the policy
      being trained (they write ``behaviour_logprobs`` with the weights the
      sync pump pushes); the others are frozen references (``ref_logprobs``).
      Those of them in ``batch_start_logprob_stages`` (``recompute =
      batch_start``) are called by the train pump instead, for each group
      it takes into a step, with the trainer's weights at the step's start.
    - ``generate_concurrency``: prompt groups kept in flight on each
      generator replica (it decodes them in one batch); 0 derives it: a
      step's groups spread over the replicas.
    - ``minibatch_groups`` / ``ppo_epochs``: a step (one rollout batch, one
      weight version) takes an optimizer step after every
      ``minibatch_groups`` prompt groups, over ``ppo_epochs`` passes; the
      first pass streams groups as they arrive. 0 = the whole step.
    - ``advantage`` / ``normalize``: the estimator and its scaling
      (``advantages.compute_advantages``); ``"batch"`` waits for the whole
      rollout batch before its first microbatch (as do ``"group_batch"`` and
      ``"batch_tokens"``, ``"group_batch_tokens"`` and ``"batch_std"``). Each
      reward becomes ``(reward + reward_bias) x reward_scale``, then
      ``reward_clip`` bounds it, before the baseline (``reward_clip_at =
      "after_baseline"``: after it and a group's scaling); ``advantage_clip``
      bounds the advantages after the scaling (0: off). ``advantage_eps`` is
      added to every std divided by; ``advantage_std`` picks the unbiased or
      the biased std.
    - ``dynamic_sampling``: a group whose rewards are all equal is dropped
      (``zero_variance``) and another prompt is sampled in its place.
    - ``difficulty_mask``: ``(low, high)``, or None. A group whose mean reward
      is not strictly between them stays in its step but out of its loss and
      of the advantages' batch statistics (ledger outcome ``masked``); no
      prompt replaces it.
    - ``sleeping_replicas``: the generator replicas that share GPUs with the
      trainer. They sleep while a step trains and are refreshed when they
      wake; the others keep generating (partial overlap). All of them:
      full colocation, generation and training take turns.
    - ``replica_leases`` / ``trainer_lease``: the GPUs each generator replica
      (by index; empty or missing: none) and the trainer share with other
      pipelines. A replica with any serves only while it holds their lease,
      and a step trains only while the trainer holds its own
      (``leases.py``, ``lease_pump.py``).
    """

    pipeline: str
    prompts_per_step: int
    samples_per_prompt: int
    steps: int
    max_lag: int = _STALENESS.max_lag
    order: Order = _STALENESS.order
    too_stale: TooStale = _STALENESS.too_stale
    max_ahead: float | None = _STALENESS.max_ahead
    buffer_capacity: int = 0  # 0 = one staleness window
    max_inflight: int = 0  # 0 = buffer_capacity
    reward_stages: tuple[str, ...] = ()
    logprob_stages: tuple[str, ...] = ()
    policy_logprob_stages: tuple[str, ...] = ()
    batch_start_logprob_stages: tuple[str, ...] = ()  # policy stages scoring at the trainer's version
    sync_bucket_bytes: int = 256 * MIB
    watchdog_timeout_s: float = 300.0
    max_new_tokens: int = 0  # the longest response a generator writes (0: unknown): the watchdog waits for one
    advantage_eps: float = 1e-6
    seed: int = 0
    max_aborted_steps: int = 3  # consecutive aborts before the run gives up
    generate_concurrency: int = 0  # 0 = derived per replica
    sleeping_replicas: tuple[int, ...] = ()
    minibatch_groups: int = 0  # 0 = prompts_per_step: one optimizer step per pass
    ppo_epochs: int = 1
    advantage: str = "grpo"
    normalize: str = "group"
    reward_clip: float = 0.0
    advantage_clip: float = 0.0
    reward_scale: float = 1.0
    reward_bias: float = 0.0
    reward_clip_at: str = "before_baseline"
    advantage_std: str = "unbiased"
    dynamic_sampling: bool = False
    difficulty_mask: tuple[float, float] | None = None
    replica_leases: tuple[tuple[str, ...], ...] = ()
    trainer_lease: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _require(bool(self.pipeline), "pipeline name must not be empty")
        for name in ("prompts_per_step", "samples_per_prompt", "max_aborted_steps", "ppo_epochs"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "max_lag", "buffer_capacity", "max_inflight", "seed", "generate_concurrency",
                     "minibatch_groups"):
            _require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        _require(self.order in ("any", "in_order"), f"order must be 'any' or 'in_order', got {self.order!r}")
        _require(self.too_stale in ("drop", "wait"), f"too_stale must be 'drop' or 'wait', got {self.too_stale!r}")
        _require(self.max_ahead is None or 0 <= self.max_ahead <= self.max_lag,
                 f"max_ahead must be between 0 and max_lag {self.max_lag}, got {self.max_ahead}")
        _require(self.sync_bucket_bytes >= 1, "sync_bucket_bytes must be >= 1")
        _require(self.watchdog_timeout_s > 0, "watchdog_timeout_s must be > 0")
        _require(self.advantage_eps >= 0, "advantage_eps must be >= 0")
        _require(self.reward_clip >= 0 and self.advantage_clip >= 0, "reward_clip and advantage_clip must be >= 0")
        _require(self.advantage in ESTIMATORS, f"advantage must be one of {', '.join(ESTIMATORS)}")
        _require(self.normalize in NORMALISATIONS, f"normalize must be one of {', '.join(NORMALISATIONS)}")
        _require(self.reward_clip_at in REWARD_CLIP_PLACES,
                 f"reward_clip_at must be one of {', '.join(REWARD_CLIP_PLACES)}")
        _require(self.advantage_std in STD_KINDS, f"advantage_std must be one of {', '.join(STD_KINDS)}")
        if self.difficulty_mask is not None:
            _require(len(self.difficulty_mask) == 2, "difficulty_mask must be (low, high)")
            object.__setattr__(self, "difficulty_mask", tuple(float(b) for b in self.difficulty_mask))
        if self.minibatch_groups == 0 or self.minibatch_groups > self.prompts_per_step:
            object.__setattr__(self, "minibatch_groups", self.prompts_per_step)
        object.__setattr__(self, "reward_stages", tuple(self.reward_stages))
        object.__setattr__(self, "logprob_stages", tuple(self.logprob_stages))
        object.__setattr__(self, "policy_logprob_stages", tuple(self.policy_logprob_stages))
        object.__setattr__(self, "batch_start_logprob_stages", tuple(self.batch_start_logprob_stages))
        object.__setattr__(self, "sleeping_replicas", tuple(sorted(set(self.sleeping_replicas))))
        object.__setattr__(self, "replica_leases", tuple(tuple(gpus) for gpus in self.replica_leases))
        object.__setattr__(self, "trainer_lease", tuple(self.trainer_lease))
        if self.buffer_capacity == 0:
            object.__setattr__(self, "buffer_capacity", self.window_groups)
        if self.max_inflight == 0:
            object.__setattr__(self, "max_inflight", self.buffer_capacity)

    @property
    def window_groups(self) -> int:
        """Prompt groups in one staleness window: the most that can usefully
        be outstanding at once."""
        return (self.max_lag + 1) * self.prompts_per_step

    @property
    def ahead_groups(self) -> int:
        """Groups generated before a version that may train at or after it."""
        return ahead_groups(self.max_lag, self.max_ahead, self.prompts_per_step)

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def colocated(self) -> bool:
        """Some generator replica shares GPUs with the trainer: steps and
        that replica's generation take turns."""
        return bool(self.sleeping_replicas)

    @property
    def takes_turns(self) -> bool:
        """A step waits for its groups, then takes the trainer's GPUs from
        generation: colocated, or its GPUs are leased from other pipelines."""
        return self.colocated or bool(self.trainer_lease)

    @property
    def leased(self) -> bool:
        return bool(self.trainer_lease) or any(self.replica_leases)

    def replica_lease(self, replica: int) -> tuple[str, ...]:
        return self.replica_leases[replica] if replica < len(self.replica_leases) else ()

    def replica_concurrency(self, replicas: int) -> int:
        """Groups in flight per generator replica: the declared value, or a
        step's groups spread over the replicas."""
        if self.generate_concurrency:
            return self.generate_concurrency
        return max(1, -(-self.prompts_per_step // max(1, replicas)))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"RunSettings: {message}")


def longest_response_tokens(pipe: PipelinePlan) -> int:
    """The most tokens one response of the pipeline's generators may take: `max_new_tokens`, or an
    environment's episode budget (`max_tokens`) for a generator with one."""
    budgets = [int(s.settings.get("max_new_tokens", 0)) for s in pipe.stages if s.kind == "generate"]
    budgets += [env.max_tokens for env in pipe.environments]
    return max(budgets, default=0)


def settings_from_plan(pipe: PipelinePlan, steps: int | None = None,
                       shared_gpus: frozenset[tuple[int, int]] = frozenset()) -> RunSettings:
    """The controller's settings for one pipeline of a plan; ``steps``
    overrides the plan's; ``shared_gpus``: (node, gpu) this pipeline shares
    with others, on which it takes leases."""
    stages = {s.name: s for s in pipe.stages}
    flow_order = [name for generation in pipe.generations for name in generation]
    sync = next((s for s in pipe.stages if s.kind == "sync"), None)
    train = pipe.stage(pipe.batch.train_stage)
    train_settings = train.settings
    generators = [s for s in pipe.stages if s.kind == "generate"]
    return RunSettings(
        pipeline=pipe.name,
        prompts_per_step=pipe.batch.prompts_per_step,
        samples_per_prompt=pipe.batch.samples_per_prompt,
        steps=steps if steps is not None else pipe.run.steps,
        max_lag=pipe.staleness.max_lag,
        order=pipe.staleness.order,
        too_stale=pipe.staleness.too_stale,
        max_ahead=pipe.staleness.max_ahead,
        buffer_capacity=pipe.batch.buffer_capacity,
        max_inflight=pipe.batch.max_inflight,
        reward_stages=tuple(n for n in flow_order if n in stages and stages[n].kind == "reward"),
        logprob_stages=tuple(n for n in flow_order if n in stages and stages[n].kind == "logprob"),
        policy_logprob_stages=tuple(n for n in flow_order if n in stages and stages[n].kind == "logprob"
                                    and receives_weights("logprob", bool(stages[n].settings.get("frozen")))),
        batch_start_logprob_stages=tuple(n for n in flow_order if n in stages and recomputes_at_batch_start(stages[n])),
        sync_bucket_bytes=int(sync.settings["bucket"]) if sync else 256 * MIB,
        watchdog_timeout_s=pipe.run.watchdog_s,
        max_new_tokens=longest_response_tokens(pipe),
        seed=pipe.run.seed,
        generate_concurrency=int(generators[0].settings.get("concurrency", 0)) if generators else 0,
        sleeping_replicas=sleeping_replicas(pipe),
        minibatch_groups=pipe.batch.global_batch // pipe.batch.samples_per_prompt,
        ppo_epochs=pipe.batch.ppo_epochs,
        advantage=train_settings.get("advantage", "grpo"),
        normalize=train_settings.get("normalize", "group"),
        reward_clip=float(train_settings.get("reward_clip", 0.0)),
        advantage_clip=float(train_settings.get("advantage_clip", 0.0)),
        reward_scale=float(train_settings.get("reward_scale", 1.0)),
        reward_bias=float(train_settings.get("reward_bias", 0.0)),
        reward_clip_at=train_settings.get("reward_clip_at", "before_baseline"),
        advantage_eps=float(train_settings.get("advantage_eps", 1e-6)),
        advantage_std=train_settings.get("advantage_std", "unbiased"),
        dynamic_sampling=bool(train_settings.get("dynamic_sampling", False)),
        difficulty_mask=train_settings.get("difficulty_mask"),
        replica_leases=tuple(replica_leases(pipe, shared_gpus)),
        trainer_lease=_gpu_ids(train.ranks, shared_gpus),
    )


def sleeping_replicas(pipe: PipelinePlan) -> tuple[int, ...]:
    """Generator replicas (ranks of the generate stages, in stage order) whose
    GPUs the trainer also uses; a replica without planned GPUs sleeps when
    its stage is colocated with the trainer."""
    train = pipe.stage(pipe.batch.train_stage)
    trainer_gpus = {(rank.node, gpu) for rank in train.ranks for gpu in rank.gpus}
    replicas = [(stage, rank) for stage in pipe.stages if stage.kind == "generate" for rank in stage.ranks]
    return tuple(index for index, (stage, rank) in enumerate(replicas)
                 if ({(rank.node, gpu) for gpu in rank.gpus} & trainer_gpus)
                 or (not rank.gpus and train.name in stage.colocated_with))


def gpu_id(node: int, gpu: int) -> str:
    """A GPU as the lease scheduler names it."""
    return f"{node}:{gpu}"


def _gpu_ids(ranks, shared_gpus: frozenset[tuple[int, int]]) -> tuple[str, ...]:
    return tuple(sorted({gpu_id(*where) for rank in ranks for where in rank.all_gpus() if where in shared_gpus}))


def replica_leases(pipe: PipelinePlan, shared_gpus: frozenset[tuple[int, int]]) -> list[tuple[str, ...]]:
    """For each generator replica (ranks of the generate stages, in stage
    order), the GPUs it shares with other pipelines."""
    return [_gpu_ids([rank], shared_gpus) for stage in pipe.stages if stage.kind == "generate"
            for rank in stage.ranks]
