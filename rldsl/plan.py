"""The ExecutionPlan: the one boundary between compiler and runtime.

Plain dataclasses of JSON values; ``to_json`` / ``from_json`` round-trip
exactly. The runtime reads nothing else (not the .rlp file, not the AST).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from rldsl.collective_rule import WeightReceiver, collective_blocker

PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ClusterPlan:
    nodes: int
    gpus_per_node: int
    gpu_type: str | None = None
    gpu_memory_bytes: int | None = None
    cpus_per_node: int | None = None


@dataclass(frozen=True)
class EnginePlan:
    name: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeGpus:
    node: int
    gpus: list[int]  # local GPU ids on ``node``


@dataclass(frozen=True)
class RankPlan:
    index: int
    node: int
    gpus: list[int]  # local GPU ids on ``node``; empty for CPU ranks
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    gpu_fraction: float = 0.0  # of each GPU in ``gpus``: colocated actors share a bundle
    # A replica actor whose engine also drives GPUs on further nodes (vLLM
    # with pp > 1): those GPUs, node by node; the actor itself runs on ``node``.
    remote: list[NodeGpus] = field(default_factory=list)

    def all_gpus(self) -> list[tuple[int, int]]:
        """(node, local GPU) of every GPU the rank drives, here and remote."""
        return [(self.node, g) for g in self.gpus] + [(r.node, g) for r in self.remote for g in r.gpus]


@dataclass(frozen=True)
class StagePlan:
    name: str
    kind: str  # generate | reward | logprob | train | sync
    engine: EnginePlan | None
    model: str | None
    settings: dict[str, Any]
    ranks: list[RankPlan] = field(default_factory=list)
    tp: int = 1
    pp: int = 1
    dp: int = 1
    colocated_with: list[str] = field(default_factory=list)

    @property
    def served_by(self) -> str | None:
        """`pipeline/stage` of the generator that serves this stage (`served_by`): ``ranks`` are that
        generator's, for counting replicas; it has no actors of its own."""
        return self.settings.get("served_by")

    @property
    def on_trainer(self) -> str | None:
        """The train stage whose actors score this frozen reference with their LoRA policy's adapters off
        (no copy of the model of its own): ``ranks`` are that trainer's."""
        return self.settings.get("on_trainer")

    @property
    def own_ranks(self) -> list[RankPlan]:
        """The ranks this stage starts actors for: none when another pipeline's generator serves it or its
        trainer scores it."""
        return [] if self.served_by or self.on_trainer else self.ranks


@dataclass(frozen=True)
class EdgePlan:
    src: str
    dst: str
    kind: str  # data | weights
    fields: list[str] = field(default_factory=list)
    via: str | None = None  # the sync stage of a weights edge


@dataclass(frozen=True)
class LoraPlan:
    """Low-rank adapters trained, pushed and checkpointed instead of the
    model's weights (rldsl.models.lora); the base stays as loaded."""

    rank: int
    alpha: float
    targets: list[str]  # module names given an adapter

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# The linear layers a model's adapters go on when `lora_targets` is left out: the attention's, as PEFT's
# examples do (the builtin model's fused qkv and output projections; GPT-2's fused c_attn; q and v elsewhere).
LORA_DEFAULT_TARGETS = {"builtin:tiny-lm": ["qkv", "out"], "builtin:tiny-gpt2": ["c_attn"],
                        "builtin:tiny-agent": ["qkv", "out"]}
LORA_HF_DEFAULT_TARGETS = ["q_proj", "v_proj"]


def lora_default_targets(source: str) -> list[str]:
    return list(LORA_DEFAULT_TARGETS.get(source, LORA_HF_DEFAULT_TARGETS))


def hf_expert_count(config: Mapping) -> int:
    """The routed experts a Hugging Face config declares (Qwen-MoE's
    ``num_experts``, Mixtral's ``num_local_experts``, DeepSeek's
    ``n_routed_experts``); 0 for a dense model."""
    return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)


@dataclass(frozen=True)
class ModelPlan:
    name: str
    source: str
    params: int | None = None
    dtype: str | None = None
    chat_template: bool = False  # prompts go through the tokenizer's chat template (hf: models)
    lora: LoraPlan | None = None  # None: every weight is trained and pushed


@dataclass(frozen=True)
class EnvironmentPlan:
    """A multi-turn environment a generate stage runs its episodes in
    (``rldsl.runtime.environments``)."""

    name: str
    fn: str  # "module:Class"
    max_turns: int
    max_tokens: int  # an episode's response budget: the model's and the environment's tokens
    timeout_s: float = 10.0  # per reset or step call (0: none)
    processes: int = 2
    tools: list[str] = field(default_factory=list)  # "module:function" the model may call
    tool_format: str | None = None  # how its completions call them (TOOL_FORMATS); None: they never do
    max_observation_tokens: int | None = None  # each environment or tool message's content at most
    straggler: float = 0.0  # a call this many times the usual call time is taken for hung (0: only the timeout)


TOOL_FORMATS = ("hermes", "pythonic")  # rldsl.runtime.environments.tool_calls parses each


# The reward function that reads an environment episode's summed reward (the
# generator's `episode_reward` field) instead of scoring text.
EPISODE_REWARD_FN = "rldsl.environments:episode_reward"


@dataclass(frozen=True)
class DatasetPlan:
    name: str
    source: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StalenessPlan:
    """The defaults are the language's (the schema reads them from here), so a
    hand-built ``RunSettings`` means what an .rlp file that leaves them out means."""

    max_lag: int = 0
    order: str = "any"
    too_stale: str = "wait"
    # Prompt groups that may be generated ahead of the trainer, in steps; None: max_lag (sampler.py).
    max_ahead: float | None = None


# Each advantage estimator and how it scales its advantages unless the file
# says `normalize` (the language's default, which the compiler writes into
# the plan; the runtime's advantages.py computes them).
ADVANTAGE_NORMALISATION = {"grpo": "group", "dr_grpo": "none", "rloo": "none", "reinforce_pp": "batch",
                           "reinforce_pp_baseline": "batch"}
# Every `normalize`: the group's std, each sample's leave-one-out std, the batch's, the group's std then
# whitened over the batch, none, whitened over the batch's trained tokens (a sample weighs its token count),
# the group's std then whitened over the batch's tokens (AReaL), the batch's reward std without whitening (TRL).
NORMALISATIONS = ("group", "leave_one_out", "batch", "group_batch", "none", "batch_tokens", "group_batch_tokens",
                  "batch_std")
GROUP_SCALED = ("group", "group_batch", "group_batch_tokens")  # normalisations that divide by a group's spread
ADVANTAGE_STDS = ("unbiased", "biased")  # a train stage's `advantage_std`; the first is the default
REWARD_CLIP_PLACES = ("before_baseline", "after_baseline")  # a train stage's `reward_clip_at`; likewise


@dataclass(frozen=True)
class BatchPlan:
    train_stage: str
    prompts_per_step: int
    samples_per_prompt: int
    global_batch: int  # samples per optimizer step: a divisor of the rollout batch
    micro_batch: int
    buffer_capacity: int
    max_inflight: int
    ppo_epochs: int = 1

    @property
    def rollout_batch(self) -> int:
        """Samples generated and trained per step (one weight version)."""
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def minibatches(self) -> int:
        """Optimizer steps per pass over a rollout batch."""
        return max(1, self.rollout_batch // self.global_batch)

    @property
    def optimizer_steps_per_step(self) -> int:
        return self.minibatches * self.ppo_epochs


def ahead_groups(max_lag: int, max_ahead: float | None, prompts_per_step: int) -> int:
    """Prompt groups generated before a version that may train at or after
    it: ``max_ahead`` steps of ``prompts_per_step``, whole groups only
    (verl rounds its staleness_threshold the same way); ``max_lag`` steps
    when unset. The epsilon keeps 0.29 x 100 at 29 groups."""
    if max_ahead is None:
        return max_lag * prompts_per_step
    return math.floor(max_ahead * prompts_per_step + 1e-9)


def receives_weights(kind: str, frozen: bool = False) -> bool:
    """The one rule for which stages take the trainer's weights: generators
    and policy (not frozen) logprob stages. The compiler requires a sync to
    each such stage of a trained model (RLP205) and refuses one to any other
    (RLP206); the runtime pushes along exactly those syncs."""
    return kind == "generate" or (kind == "logprob" and not frozen)


def recomputes_at_batch_start(stage: "StagePlan") -> bool:
    """A policy logprob stage with ``recompute = batch_start``: it scores
    each row with the trainer's weights at the start of the step that
    trains it, and the trainer's fence compares with its own version."""
    return (stage.kind == "logprob" and not stage.settings.get("frozen")
            and stage.settings.get("recompute") == "batch_start")


def truncates_long_prompts(dataset_options: Mapping[str, Any]) -> bool:
    """A dataset that cuts prompts over `max_prompt_tokens` (`long_prompts =
    truncate`) rather than dropping them: its generate stages then write a
    ``loss_mask`` leaving those prompts' samples out of the loss."""
    return bool(dataset_options.get("max_prompt_tokens")) and dataset_options.get("long_prompts") == "truncate"


@dataclass(frozen=True)
class RunPlan:
    """``steps`` counts rollout batches (weight versions). A run written in
    ``samples`` has its steps computed by the compiler; one written in
    ``epochs`` has ``steps = 0`` until the runtime has read the dataset
    (``resolved``). ``max_steps``: a ``steps`` written beside ``epochs`` or
    ``samples``; the run ends at whichever bound it reaches first."""

    steps: int
    seed: int
    eval_every: int
    checkpoint_every: int
    watchdog_s: float
    restarts: int = 2  # the language's default: a lost trainer restarts from the last checkpoint this often
    epochs: int = 0  # the run's length in passes over the training prompts, when written so
    samples: int = 0  # ... in trained samples, when written so
    log: list[str] = field(default_factory=lambda: ["tensorboard"])  # metric backends besides metrics.jsonl
    keep_checkpoints: int = 0  # the newest complete checkpoints kept (0: all)
    eval_timeout_s: float = 0.0  # a held-out evaluation not answered this long after its request times out (0: never)
    max_steps: int = 0  # 0: no second bound
    eval_at_start: bool = True  # held-out evaluation of the weights before the first step
    eval_at_end: bool = True  # ... and of the last step's, even off the `eval_every` grid

    def resolved(self, train_prompts: int, prompts_per_step: int) -> "RunPlan":
        """Steps from epochs, once the number of training prompts is known
        (whole steps: a last partial rollout batch is not trained)."""
        if not self.epochs:
            return self
        steps = max(1, self.epochs * train_prompts // prompts_per_step)
        return dataclasses.replace(self, steps=min(steps, self.max_steps or steps))

    @property
    def asks_evaluation(self) -> bool:
        return bool(self.eval_every or self.eval_at_start or self.eval_at_end)


@dataclass(frozen=True)
class SharingPlan:
    """How the cluster's GPU lease scheduler weighs this pipeline against the
    others it shares GPUs with: a higher ``priority`` is served first; among
    equals, GPU time is shared in proportion to ``weight``."""

    weight: float = 1.0
    priority: int = 0


LEASE_QUANTUM_S = 2.0  # a busy generation lease is kept at least this long before fair share asks it back


@dataclass(frozen=True)
class PipelinePlan:
    name: str
    models: list[ModelPlan]
    datasets: list[DatasetPlan]
    stages: list[StagePlan]
    edges: list[EdgePlan]
    generations: list[list[str]]
    staleness: StalenessPlan
    batch: BatchPlan
    run: RunPlan
    sharing: SharingPlan = field(default_factory=SharingPlan)
    environments: list[EnvironmentPlan] = field(default_factory=list)

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)

    def environment(self, name: str) -> EnvironmentPlan:
        return next(e for e in self.environments if e.name == name)

    def model(self, name: str) -> ModelPlan:
        return next(m for m in self.models if m.name == name)

    def stages_of(self, kind: str) -> list[StagePlan]:
        return [s for s in self.stages if s.kind == kind]

    def weight_receivers(self) -> set[str]:
        """The stages the trainer's weights are pushed to: the targets of its
        syncs (which the compiler made exactly the ``receives_weights`` stages
        of the trained model)."""
        return {e.dst for e in self.edges if e.kind == "weights"}

    def collective_blocker(self, receivers_sleep: bool = False) -> str | None:
        """``collective_blocker`` for this plan's trainer and weight receivers."""
        trainer = self.stage(self.batch.train_stage)
        trainer_gpus = _gpus_of(trainer)
        receivers = [WeightReceiver(s.name, s.kind, s.engine.name if s.engine else None,
                                    bool(trainer_gpus & _gpus_of(s)), s.settings.get("served_by"))
                     for s in self.stages if s.name in self.weight_receivers()]
        return collective_blocker(trainer.name, trainer.engine.name if trainer.engine else None, receivers,
                                  receivers_sleep)

    @property
    def eval_size(self) -> int:
        """Held-out prompts per evaluation (the compiler fills the default)."""
        return self.datasets[0].options["eval_size"] if self.datasets else 0

    @property
    def evaluates(self) -> bool:
        """Held-out evaluation runs (in an evaluator actor on the CPU): the
        policy has real weights, the dataset a held-out split and the run
        asks for at least one evaluation."""
        train = self.stage(self.batch.train_stage)
        return evaluates_held_out(train.engine.name, bool(self.stages_of("generate")), self.eval_size,
                                  self.run.asks_evaluation)

    @property
    def eval_on(self) -> str:
        """Where held-out evaluation decodes: ``evaluator`` (a CPU copy of
        the policy in an actor of its own) or ``generators`` (the generate
        stage's replicas, with the weights they hold)."""
        return (self.datasets[0].options.get("eval_on") or "evaluator") if self.datasets else "evaluator"

    @property
    def has_evaluator(self) -> bool:
        """An evaluator actor runs (evaluation on, and not on the generators)."""
        return self.evaluates and self.eval_on == "evaluator"


WEIGHT_ENGINES = ("torch", "megatron", "fsdp")  # trainers with real weights to evaluate


def evaluates_held_out(train_engine: str, has_generator: bool, eval_size: int, asks_evaluation: bool) -> bool:
    """The one rule for whether a pipeline runs held-out evaluation (the plan's ``evaluates``, and `check`)."""
    return train_engine in WEIGHT_ENGINES and has_generator and eval_size > 0 and asks_evaluation


def _gpus_of(stage: StagePlan) -> set[tuple[int, int]]:
    return {place for rank in stage.ranks for place in rank.all_gpus()}


@dataclass(frozen=True)
class ExecutionPlan:
    cluster: ClusterPlan
    pipelines: list[PipelinePlan]
    source_file: str = ""
    source_sha256: str = ""
    warnings: list[str] = field(default_factory=list)
    schema_version: int = PLAN_SCHEMA_VERSION
    overrides: list[str] = field(default_factory=list)  # `--set` settings written into the source before compiling

    def pipeline(self, name: str | None = None) -> PipelinePlan:
        if name is None:
            return self.pipelines[0]
        return next(p for p in self.pipelines if p.name == name)

    def gpu_users(self) -> dict[tuple[int, int], list[str]]:
        """(node, gpu) -> the pipelines with ranks on it, for every GPU the plan uses."""
        users: dict[tuple[int, int], set[str]] = {}
        for pipe in self.pipelines:
            for stage in pipe.stages:
                for rank in stage.own_ranks:
                    for where in rank.all_gpus():
                        users.setdefault(where, set()).add(pipe.name)
        return {where: sorted(names) for where, names in sorted(users.items())}

    def gpus_shared_across_pipelines(self) -> dict[tuple[int, int], list[str]]:
        return {where: names for where, names in self.gpu_users().items() if len(names) > 1}

    def shared_gpus_of(self, pipeline: str) -> frozenset[tuple[int, int]]:
        """The (node, gpu) the pipeline shares with another: it takes turns on them."""
        return frozenset(where for where, names in self.gpus_shared_across_pipelines().items() if pipeline in names)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "ExecutionPlan":
        data = json.loads(text)
        version = data.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise PlanFormatError(f"plan schema version {version}, this rldsl reads version {PLAN_SCHEMA_VERSION}; "
                                  "re-create the plan with `rldsl plan --out`")
        return _build(ExecutionPlan, data)


class PlanFormatError(ValueError):
    pass


def _build(cls, data):
    """Rebuild nested dataclasses from ``asdict`` output using the type hints."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _value(hints[f.name], data[f.name])
    return cls(**kwargs)


def _value(hint, value):
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value)
    if origin is list:
        return [_value(args[0], v) for v in value]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], value) if len(inner) == 1 else value
    return value
