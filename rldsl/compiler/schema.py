"""What each block and stage kind accepts: keys, types, defaults, docs.

This table is the single source of truth for the resolver and for the key
reference in docs/language.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rldsl.compiler.types import (
    COUNT, DURATION, SIZE, Bool, CallOf, EngineSpec, Enum, Float, Fraction, GpuRequest, GroupItem, Gpus, Int,
    ListOf, LossSpec, RefTo, SleepLevel, Str,
)
from rldsl.compiler.reward_types import RewardFns
from rldsl.plan import (
    ADVANTAGE_NORMALISATION,
    ADVANTAGE_STDS,
    NORMALISATIONS,
    REWARD_CLIP_PLACES,
    TOOL_FORMATS,
    RunPlan,
    StalenessPlan,
)

UPDATE_MODES = ("between_requests", "interrupt")  # a generate stage's `update`; the first is the default
EVAL_ON = ("evaluator", "generators")  # a dataset's `eval_on`; the first is the default
RECOMPUTE_MODES = ("behaviour", "batch_start")  # a policy logprob stage's `recompute`; the first is the default
INTERRUPTING_ENGINES = ("torch", "vllm")  # engines that resume rows in flight under new weights (RLP110)
# logprob engines whose forwards rldsl chooses, so `micro_batch_tokens` applies (RLP108)
TOKEN_BUDGET_LOGPROB_ENGINES = ("torch", "fsdp", "megatron", "sim")
LONG_PROMPTS = ("drop", "truncate")  # a dataset's `long_prompts`

REQUIRED = object()  # a key without a default
DERIVED = object()  # a default computed from other settings by a later pass


@dataclass(frozen=True)
class Key:
    type: Any
    default: Any = None
    doc: str = ""


@dataclass(frozen=True)
class EngineInfo:
    stage_kinds: tuple[str, ...]
    args: dict
    can_sleep_arg: str | None  # the bool argument that enables sleep/offload
    gpu_only: bool
    replica_actor_kinds: tuple[str, ...]  # stage kinds where one actor drives a whole replica (vLLM) vs one per GPU
    doc: str
    pp_kinds: tuple[str, ...] = ()  # stage kinds that may use pipeline parallelism (pp > 1)


_PARALLEL = {"tp": Int(low=1), "pp": Int(low=1)}
_DTYPE = Enum(("fp32", "bf16", "fp16"))

ENGINES: dict[str, EngineInfo] = {
    "torch": EngineInfo(
        ("generate", "logprob", "train", "reward"), {"dtype": _DTYPE, "offload": Bool()}, "offload", False, (),
        "plain PyTorch on CPU or GPU; the builtin tiny model and local Hugging Face models"),
    "vllm": EngineInfo(
        ("generate", "logprob", "reward"),
        {**_PARALLEL, "gpu_memory": Fraction(), "sleep": SleepLevel(), "max_model_len": Int(low=1),
         "dtype": _DTYPE, "kv_cache": SIZE},
        "sleep", True, ("generate", "logprob", "reward"),
        "vLLM's engine; `gpu_memory` is the share of each GPU it reserves, `kv_cache` (a size) its KV cache "
        "instead (on a CPU, where `gpu_memory` is a share of host memory, give `kv_cache`); a replica is tp x pp "
        "GPUs and, with pp > 1, may span nodes (whole tp groups on each)",
        pp_kinds=("generate", "logprob")),
    "sglang": EngineInfo(
        ("generate", "logprob"),
        {"tp": Int(low=1), "gpu_memory": Fraction(), "sleep": SleepLevel(), "max_model_len": Int(low=1),
         "dtype": _DTYPE, "deterministic": Bool()},
        "sleep", True, ("generate", "logprob"),
        "SGLang's offline engine; `gpu_memory` is the share of each GPU it reserves (`mem_fraction_static`); "
        "`deterministic` turns on its deterministic inference, without which it ignores each sample's seed"),
    "megatron": EngineInfo(
        ("train", "logprob"),
        {**_PARALLEL, "ep": Int(low=1), "etp": Int(low=1), "offload": Bool(), "dtype": _DTYPE,
         "distributed_optimizer": Bool()},
        "offload", True, (), "megatron-core split-step trainer; on a mixture-of-experts model `ep` shards the "
        "experts over that many ranks, each split `etp` ways (default: `tp`)", pp_kinds=("train", "logprob")),
    "fsdp": EngineInfo(
        ("train", "logprob"), {"shard": Int(low=0), "offload": Bool(), "dtype": Enum(("fp32", "bf16"))},
        "offload", False, (),
        "torch FSDP2 (`fully_shard`): parameters, gradients and AdamW state sharded over the trainer's ranks "
        "(`shard` ranks per copy; 0: all of them); a logprob stage shards its model only with `shard` written "
        "(left out: 1, a whole copy per rank)"),
    "sim": EngineInfo(
        ("generate", "logprob", "train"),
        {"latency": DURATION, "tail": Fraction(), "tail_factor": Float(low=1), "jitter": Fraction(), "sleep": Bool(),
         "tp": Int(low=1), "pp": Int(low=1)},
        "sleep", False, ("generate",),
        "calibrated latencies without a model (a generator replica is one actor, like vLLM's), for scheduler tests "
        "and benchmarks",
        pp_kinds=("generate", "logprob", "train")),
}

ENGINE_ARG_DEFAULTS = {
    "torch": {"dtype": "fp32", "offload": True},
    "vllm": {"tp": 1, "pp": 1, "gpu_memory": 0.9, "sleep": 1, "dtype": "bf16"},  # sleep: the level
    "sglang": {"tp": 1, "gpu_memory": 0.9, "sleep": 1, "dtype": "bf16", "deterministic": False},  # sleep: the level
    "megatron": {"tp": 1, "pp": 1, "offload": True, "dtype": "bf16", "distributed_optimizer": True},
    "fsdp": {"shard": 0, "offload": True, "dtype": "fp32"},
    "sim": {"latency": 0.01, "tail": 0.0, "tail_factor": 10.0, "jitter": 0.1, "sleep": True},
}


def _engine(name: str, args: dict, span, arg_spans, name_span) -> EngineSpec:
    return EngineSpec(name, {**ENGINE_ARG_DEFAULTS[name], **args}, span, arg_spans, name_span)


def stage_engine_args(engine: EngineSpec, kind: str) -> dict:
    """The engine's arguments on a stage of ``kind``. An fsdp logprob stage's
    `shard` left out is 1: each rank holds the whole model and serves alone
    (`shard = 0` or S shards it like the trainer)."""
    args = dict(engine.args)
    if engine.name == "fsdp" and kind == "logprob" and "shard" not in (engine.arg_spans or {}):
        args["shard"] = 1
    return args


def _loss(name: str, args: dict, span, arg_spans, name_span) -> LossSpec:
    return LossSpec(name, {**LOSS_DEFAULTS[name], **args}, span, arg_spans)


ENGINE = CallOf("engine", {n: e.args for n, e in ENGINES.items()}, _engine)
# The clipped policy-gradient family (docs/language.md#the-loss); the engines
# read the same names (rldsl.runtime.engines.policy_loss.PolicyLossConfig).
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "micro_token_mean")
LOSSES = {"grpo": {
    "clip": Fraction(), "clip_high": Fraction(), "dual_clip": Float(low=0), "kl": Float(low=0),
    "kl_estimator": Enum(("k1", "k2", "k3")), "kl_in": Enum(("loss", "reward")), "agg": Enum(AGGREGATIONS),
    "ratio": Enum(("token", "sequence")), "behaviour_cap": Float(low=0),
    "kl_input_clamp": Float(low=0), "kl_output_clamp": Float(low=0),
    "correction": Enum(("none", "is", "tis", "mis", "icepop")), "correction_level": Enum(("token", "sequence")),
    "correction_low": Float(low=0), "correction_high": Float(low=0),
    "length_norm": Float(low=0), "count_masked": Bool(), "rejected": Enum(("drop", "zero", "unmask")),
    "rejected_in_ratio": Bool(), "kl_weighted": Bool(),
}}
LOSS_DEFAULTS = {"grpo": {"clip": 0.2, "dual_clip": 0.0, "kl": 0.0, "kl_estimator": "k3", "kl_in": "loss",
                          "agg": "token_mean", "ratio": "token", "behaviour_cap": 0.0,
                          "kl_input_clamp": 0.0, "kl_output_clamp": 0.0, "correction": "none",
                          "correction_level": "token"}}  # clip_high: clip's; correction_low/high: the correction's;
# length_norm, count_masked, rejected*, kl_weighted: PolicyLossConfig's defaults (plans stay as they were)
ADVANTAGES = tuple(ADVANTAGE_NORMALISATION)
GROUP_BASELINES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")  # zero advantages with one sample
LOSS = CallOf("loss", LOSSES, _loss)

_DATA_SOURCE = Str(r"(builtin:[\w\-]+|jsonl:.+)", "a dataset source",
                   'use "builtin:arith", "builtin:reverse" or "jsonl:path/to/file.jsonl"')

_GPU_PLACEMENT = {
    "gpus": Key(Gpus(), GpuRequest(1, None, None), "GPU count (placed automatically) or GPU ids `0..3`"),
    "colocate": Key(RefTo(("stage",)), None, "share the GPUs of another stage, sleeping/offloading in turn"),
}

_FUNCTION = r"[A-Za-z_][\w.]*:[A-Za-z_]\w*"  # a `module:function` reference
JUDGE_MODES = ("score", "generate")  # a reward model's `judge`; the first is the default
# A reward stage's reward model (docs/language.md#stage-reward); every key but `model` means nothing without one
# (RLP113), and a stage without one keeps a plan as before: no engine, none of these settings.
REWARD_MODEL_KEYS = {
    "model": Key(RefTo(("model",)), None, "a reward model scoring each response, a component named after the "
                                          "stage (then `fn` is optional)"),
    "engine": Key(ENGINE, EngineSpec("torch", dict(ENGINE_ARG_DEFAULTS["torch"]), None),
                  "the reward model's engine: `torch` or `vllm`"),
    **_GPU_PLACEMENT,
    "judge": Key(Enum(JUDGE_MODES), JUDGE_MODES[0], "`score`: a sequence-classification model's logit is the "
                                                    "reward; `generate`: the model answers a judge prompt and "
                                                    "`parse` reads the reward from its text"),
    "template": Key(Str(_FUNCTION, "a `module:function` reference", 'for example "rldsl.rewards.judge:judge_prompt"'),
                    "rldsl.rewards.judge:judge_prompt",
                    "`judge = generate`: `(prompt, response, answer) -> str`, the judge's prompt"),
    "parse": Key(Str(_FUNCTION, "a `module:function` reference", 'for example "rldsl.rewards.judge:first_number"'),
                 "rldsl.rewards.judge:out_of_ten",
                 "`judge = generate`: `(text) -> float`, the reward read from the judge's answer"),
    "weight": Key(Float(), 1.0, "the reward model's weight in the stage's sum"),
    "max_new_tokens": Key(Int(low=1), 16, "`judge = generate`: the judge's answer length limit in tokens"),
    "micro_batch": Key(Int(low=1), 8, "responses per forward (or per greedy decode) of the reward model"),
}
JUDGE_KEYS = tuple(k for k in REWARD_MODEL_KEYS if k != "model")

# A generate stage `served_by` another pipeline takes these from that pipeline's generator: one engine samples
# every pipeline's requests the same way (RLP514 when one is written); the others stay its own.
SERVER_KEYS = ("engine", "gpus", "colocate", "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k",
               "stop_token_ids", "update", "environment")

STAGE_KEYS: dict[str, dict[str, Key]] = {
    "generate": {
        "model": Key(RefTo(("model",)), REQUIRED, "the model generated from"),
        "engine": Key(ENGINE, EngineSpec("torch", dict(ENGINE_ARG_DEFAULTS["torch"]), None), "generation engine"),
        **_GPU_PLACEMENT,
        "samples_per_prompt": Key(Int(low=1), REQUIRED, "responses sampled per prompt (the GRPO group size)"),
        "max_new_tokens": Key(Int(low=1), 64, "response length limit in tokens"),
        "min_new_tokens": Key(Int(low=0), 0, "the fewest tokens a response has: EOS and stop tokens are held back "
                                             "until then (held-out evaluation is not held back)"),
        "temperature": Key(Float(low=0), 1.0, "sampling temperature"),
        "top_p": Key(Fraction(), 1.0, "nucleus sampling share"),
        "top_k": Key(Int(low=0), 0, "sample among the k most likely tokens (0: all)"),
        "truncated": Key(Enum(("train", "mask")), "train", "a response cut at `max_new_tokens` before it ended: "
                                                          "trained like any other, or `mask`ed out of the loss"),
        "stop_token_ids": Key(ListOf(Int(low=0)), [], "token ids that end a response besides EOS (kept in it, as "
                                                       "EOS is)"),
        "logprobs": Key(Bool(), True, "return per-token behaviour logprobs"),
        "concurrency": Key(Int(low=0), 0, "prompt groups in flight per replica, decoded as one batch "
                                           "(0: a step's groups spread over the replicas)"),
        "environment": Key(RefTo(("environment",)), None, "a multi-turn environment each sample runs an episode "
                           "in (`max_new_tokens` is then each turn's budget)"),
        "update": Key(Enum(UPDATE_MODES), UPDATE_MODES[0], "when a new weight version reaches decoding: "
                      "`between_requests` (a sample has one version) or `interrupt` (at the next decode step; "
                      "tokens record their versions)"),
        "served_by": Key(RefTo(("pipeline",)), None, "another pipeline whose generator serves this stage: one "
                         "engine over the base both models share, each pipeline's LoRA adapters per request "
                         "(its engine, GPUs and sampling keys are that generator's)"),
    },
    "reward": {
        "fn": Key(RewardFns(Str(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", "a `module:function` reference",
                                'for example "rldsl.rewards:exact_match"')), None,
                  "the reward function, `module:function`; or named components summed with weights, "
                  "`[correct(\"m:f\"), format(\"m:g\", weight = 0.1)]`, each logged as `reward/<name>` "
                  "(required unless `model` is given)"),
        "workers": Key(Int(low=1), 1, "CPU worker processes"),
        "timeout": Key(DURATION, 10.0, "per-sample limit; a slower reward drops the sample"),
        "straggler": Key(Float(low=0), 0.0, "a sample that runs this many times the reward's usual time per "
                                            "sample (at least 0.1 s) is taken for hung and dropped before "
                                            "`timeout` (0: only `timeout`)"),
        # 2: rldsl.runtime.reward_pool.DEFAULT_PROCESSES (the compiler imports no runtime)
        "processes": Key(Int(low=1), 2, "reward processes per worker: a call's samples are scored across "
                                        "them, and a hung or crashed one is killed and replaced"),
        **REWARD_MODEL_KEYS,
    },
    "logprob": {
        "model": Key(RefTo(("model",)), REQUIRED, "the model scored with"),
        "frozen": Key(Bool(), False, "a frozen reference (ref_logprobs) rather than the policy (behaviour_logprobs)"),
        "engine": Key(ENGINE, EngineSpec("torch", dict(ENGINE_ARG_DEFAULTS["torch"]), None), "logprob engine"),
        **_GPU_PLACEMENT,
        "micro_batch": Key(Int(low=1), 8, "rows per forward pass"),
        "micro_batch_tokens": Key(Int(low=0), 0, "token budget (prompt + response) of one forward, rows packed up "
                                                 "to it, a longer row alone (0: `micro_batch` rows; engines "
                                                 "`torch`, `fsdp` and `megatron`)"),
        "recompute": Key(Enum(RECOMPUTE_MODES), RECOMPUTE_MODES[0],
                         "a policy stage's weights per row: `behaviour` (the version that generated it) or "
                         "`batch_start` (the trainer's, at the start of the step that trains it)"),
    },
    "train": {
        "model": Key(RefTo(("model",)), REQUIRED, "the model trained"),
        "engine": Key(ENGINE, EngineSpec("torch", dict(ENGINE_ARG_DEFAULTS["torch"]), None), "training engine"),
        **_GPU_PLACEMENT,
        "prompts_per_step": Key(Int(low=1), REQUIRED, "prompt groups per optimizer step"),
        "global_batch": Key(Int(low=1), DERIVED, "samples per optimizer step (default: the rollout batch, "
                                                  "prompts_per_step x samples_per_prompt; a divisor of it takes "
                                                  "several optimizer steps per rollout batch)"),
        "ppo_epochs": Key(Int(low=1), 1, "passes over each rollout batch"),
        "micro_batch": Key(Int(low=1), DERIVED, "samples per forward/backward on one rank (default: one group)"),
        "micro_batch_tokens": Key(Int(low=0), 0, "token budget of one forward on one rank, rows packed up to it "
                                                 "(0: `micro_batch` rows)"),
        "loss": Key(LOSS, LossSpec("grpo", dict(LOSS_DEFAULTS["grpo"]), None),
                    "`grpo(clip, clip_high, dual_clip, kl, kl_estimator, kl_in, agg, ratio, behaviour_cap, "
                    "kl_input_clamp, kl_output_clamp, correction, correction_level, correction_low, "
                    "correction_high, length_norm, count_masked, rejected, rejected_in_ratio, kl_weighted)`"),
        "advantage": Key(Enum(ADVANTAGES), "grpo", "advantage estimator"),
        "normalize": Key(Enum(NORMALISATIONS), DERIVED, "advantage scaling: by the group's std, by the std of "
                                                        "the group's other samples (`leave_one_out`), whitened "
                                                        "over the rollout batch, the group's std then whitened "
                                                        "(`group_batch`), none, or whitened over the batch's "
                                                        "trained tokens (`batch_tokens`: long responses weigh "
                                                        "more), the group's std then whitened over the tokens "
                                                        "(`group_batch_tokens`), by the batch's reward std "
                                                        "(`batch_std`) (default: the estimator's)"),
        "advantage_eps": Key(Float(low=0), 1e-6, "added to every std an advantage is divided by"),
        "advantage_std": Key(Enum(ADVANTAGE_STDS), ADVANTAGE_STDS[0], "the std `normalize` divides by: the "
                                                                      "unbiased (n - 1) or the biased (n) one"),
        "reward_bias": Key(Float(), 0.0, "added to each reward first: (reward + reward_bias) x reward_scale"),
        "reward_scale": Key(Float(low=0), 1.0, "each reward's factor, after `reward_bias` and before `reward_clip`"),
        "reward_clip": Key(Float(low=0), 0.0, "rewards clipped to [-c, c] before the baseline, after "
                                              "`reward_bias` and `reward_scale` (0: off)"),
        "reward_clip_at": Key(Enum(REWARD_CLIP_PLACES), REWARD_CLIP_PLACES[0],
                              "where `reward_clip` bounds the rewards: `before_baseline`, or `after_baseline` (and "
                              "after a group's std scaling, before any batch whitening)"),
        "advantage_clip": Key(Float(low=0), 0.0, "advantages clipped to [-c, c] after scaling (0: off)"),
        "dynamic_sampling": Key(Bool(), False, "drop prompt groups whose rewards are all equal and sample more "
                                               "(DAPO)"),
        "difficulty_mask": Key(ListOf(Float(), allow_single=False), None,
                               "`[low, high]`: a prompt group whose mean reward is not strictly between them stays "
                               "in its step but out of the loss, and no prompt replaces it (ROLL's "
                               "`difficulty_mask`; default: off)"),
        "lr": Key(Float(low=0), 1e-5, "AdamW learning rate"),
        "lr_schedule": Key(Enum(("constant", "linear", "cosine")), "constant", "learning rate after warmup"),
        "warmup": Key(Int(low=0), 0, "optimizer steps of linear warmup from `warmup_start_lr`"),
        "warmup_start_lr": Key(Float(low=0), 0.0, "the learning rate warmup starts from"),
        "min_lr": Key(Float(low=0), 0.0, "where `linear` and `cosine` decay to, at the run's last optimizer step"),
        "weight_decay": Key(Float(low=0), 0.0, "AdamW weight decay"),
        "adam_betas": Key(ListOf(Fraction(), allow_single=False), None,
                          "Adam's (beta1, beta2), such as `[0.9, 0.95]` (default: the engine's, (0.9, 0.99) for "
                          "`torch` and `fsdp`, (0.9, 0.999) for `megatron`)"),
        "adam_eps": Key(Float(low=0), 1e-8, "Adam's epsilon"),
        "max_grad_norm": Key(Float(low=0), 1.0, "gradient clipping (0 disables)"),
    },
    "sync": {
        "from": Key(RefTo(("stage",)), REQUIRED, "the train stage whose weights are sent"),
        "to": Key(ListOf(RefTo(("stage",))), REQUIRED, "the generate (or policy logprob) stages receiving them"),
        "bucket": Key(SIZE, 256 * 2**20, "bytes per transfer bucket"),
        "transport": Key(Enum(("auto", "collective", "object_store")), "auto",
                         "how weights travel: rank to rank in a process group of their own (`collective`), "
                         "through Ray's object store, or `auto` (collective where the receivers allow it and "
                         "the GPUs are real)"),
    },
}

BLOCK_KEYS: dict[str, dict[str, Key]] = {
    "cluster": {
        "nodes": Key(Int(low=1), 1, "machines"),
        "gpus_per_node": Key(Int(low=0), REQUIRED, "GPUs on each machine (Ray logical GPUs on a CPU machine)"),
        "gpu": Key(Str(), None, "GPU type, for the plan (for example \"H100\")"),
        "gpu_memory": Key(SIZE, None, "memory of one GPU; enables the memory check"),
        "cpus_per_node": Key(Int(low=1), None, "CPUs on each machine"),
    },
    "model": {
        "source": Key(Str(r"(builtin:[\w\-]+|hf:.+)", "a model source",
                          'use "builtin:tiny-lm" or "hf:/path/to/model"'), REQUIRED,
                      "`builtin:tiny-lm` or `hf:<local path>`"),
        "params": Key(COUNT, None, "parameter count (read from the model when omitted)"),
        "dtype": Key(_DTYPE, None, "weights dtype (default: the engine's)"),
        "chat_template": Key(Bool(), False, "format each prompt with the tokenizer's chat template, as a user turn "
                                            "(a dataset's chat messages as they are) with the assistant's turn "
                                            "opened (`hf:` instruct models)"),
        "lora_rank": Key(Int(low=0), 0, "train low-rank adapters of this rank instead of every weight, and push "
                                        "only them (0: full-parameter training; torch engines)"),
        "lora_alpha": Key(Float(low=0), None, "the adapters' scale numerator (scale = alpha / rank; default: "
                                              "twice the rank)"),
        "lora_targets": Key(ListOf(Str(r"[\w.]+", "a module name")), None,
                            "the linear layers given adapters, by module name (default: `qkv` and `out` for "
                            "the builtin model, `q_proj` and `v_proj` for Hugging Face models)"),
    },
    "dataset": {
        "source": Key(_DATA_SOURCE, DERIVED, "`builtin:arith`, `builtin:reverse` or `jsonl:<path>` "
                                             "(required unless `sources` is given)"),
        "prompt_field": Key(Str(), "prompt", "jsonl field holding the prompt: a string, or a list of chat "
                                             "messages (`{\"role\", \"content\"}`) for the chat template"),
        "answer_field": Key(Str(), "answer", "jsonl field holding the reference answer"),
        "shuffle": Key(Bool(), True, "shuffle each epoch"),
        "max_prompt_tokens": Key(Int(low=0), 0, "prompts longer than this many tokens of the policy's tokenizer "
                                                "are dropped when the dataset is read, and counted (0: keep all)"),
        "long_prompts": Key(Enum(LONG_PROMPTS), LONG_PROMPTS[0], "a prompt over `max_prompt_tokens`: `drop`ped, "
                                                               "or `truncate`d to its first `max_prompt_tokens` "
                                                               "tokens with its samples out of the loss (NeMo RL)"),
        "sources": Key(ListOf(_DATA_SOURCE), None, "a mixture: several sources, drawn by `weights` "
                                                   "(then `source` may be left out)"),
        "weights": Key(ListOf(Float(low=0)), None, "relative share of each of `sources` (default: equal)"),
        "eval_size": Key(Int(low=0), 64, "held-out prompts per evaluation (0: no evaluation)"),
        "eval_source": Key(_DATA_SOURCE, None, "the evaluation prompts (default: the held-out split of the "
                                               "first source)"),
        "eval_samples": Key(Int(low=1), 1, "responses per evaluation prompt; accuracy is their mean"),
        "eval_temperature": Key(Float(low=0), 0.0, "evaluation sampling temperature (0: greedy)"),
        "eval_top_p": Key(Fraction(), 1.0, "evaluation nucleus sampling share"),
        "eval_metric": Key(Str(r"reward|[\w.]+:\w+", "`reward` or a `module:function`",
                               'use "reward" or "rldsl.rewards:exact_match"'), "reward",
                           "how evaluation scores a response: `reward` (the pipeline's reward functions, summed) "
                           "or a `module:function` (`rldsl.rewards:exact_match`)"),
        "eval_on": Key(Enum(EVAL_ON), EVAL_ON[0],
                       "where evaluation decodes: `evaluator` (a CPU copy of the policy beside training: costs "
                       "the run nothing, slow for large models) or `generators` (the generate stage's replicas, "
                       "with the weights they hold: fast, but a replica pauses generation while it evaluates)"),
    },
    "environment": {
        "fn": Key(Str(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", "a `module:Class` reference",
                      'for example "rldsl.environments:ArithRetry"'), REQUIRED,
                  "the environment class, `module:Class`, with `reset(prompt, answer)` and "
                  "`step(messages, completion)`; or an agent harness, `module:function`, "
                  "`harness(client, prompt, answer) -> reward`; or an OpenEnv `Environment` subclass"),
        "max_turns": Key(Int(low=1), REQUIRED, "model turns per episode at most"),
        "max_tokens": Key(Int(low=1), REQUIRED, "an episode's response budget in tokens, the model's and the "
                                                "environment's together"),
        "timeout": Key(DURATION, 10.0, "limit of one `reset` or `step` call; a slower one drops its sample"),
        "straggler": Key(Float(low=0), 0.0, "a `reset` or `step` call that runs this many times the "
                                            "environment's usual call time (at least 0.2 s) is taken for hung "
                                            "and drops its sample before `timeout` (0: only `timeout`)"),
        "max_observation_tokens": Key(Int(low=1), None, "each environment or tool message's content at most, in "
                                                        "tokens (cut there); none: as long as it is"),
        "processes": Key(Int(low=1), 2, "forking servers per generator replica: each episode runs in a process of "
                                        "its own, forked from one of them"),
        "tools": Key(ListOf(Str(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", "a `module:function` reference",
                                'for example "rldsl.environments:calculate"')), [],
                     "functions the model may call, besides the environment class's own `tools`"),
        "tool_format": Key(Enum(("none", *TOOL_FORMATS)), "none",
                           "how the model writes its tool calls: `hermes` (`<tool_call>{json}</tool_call>`), "
                           "`pythonic` (`[name(arg=value)]`), or `none` (no tool calls)"),
    },
    "staleness": {
        "max_lag": Key(Int(low=0), StalenessPlan.max_lag,
                       "max trainer version minus generating version of a trained sample"),
        "order": Key(Enum(("any", "in_order")), StalenessPlan.order,
                     "`any`: by lag then arrival; `in_order`: strictly by prompt"),
        "too_stale": Key(Enum(("wait", "drop")), StalenessPlan.too_stale,
                         "`wait`: never dispatch what could go stale; `drop`: over-sample and drop stale groups"),
        "max_ahead": Key(Float(low=0), StalenessPlan.max_ahead,
                         "prompt groups generated ahead of the trainer, in steps: at most max_ahead x "
                         "prompts_per_step groups generated before a version train at or after it (default max_lag)"),
    },
    "buffer": {
        "capacity": Key(Int(low=1), DERIVED, "prompt groups stored (default prompts_per_step x (max_lag + 1))"),
        "max_inflight": Key(Int(low=1), DERIVED, "prompt groups being generated at once (default prompts_per_step)"),
    },
    "placement": {
        "groups": Key(ListOf(GroupItem(), allow_single=False), None, "stage groups sharing a slice of the cluster"),
        "ratios": Key(ListOf(Fraction(), allow_single=False), None, "each group's share of the cluster's GPUs"),
        "share": Key(ListOf(RefTo(("pipeline",))), (), "other pipelines of the file whose GPUs this one may share"),
        "weight": Key(Float(low=0.01), 1.0, "its share of the time on GPUs it shares with other pipelines, "
                                            "relative to theirs (the lease scheduler's fair share)"),
        "priority": Key(Int(low=0), 0, "on shared GPUs a pipeline of higher priority is served first"),
    },
    "run": {
        "steps": Key(Int(low=1), 20, "training steps (rollout batches); or `epochs` or `samples`, beside which "
                                     "`steps` is a cap: the run ends at whichever is reached first"),
        "epochs": Key(Int(low=1), None, "run length in passes over the training prompts"),
        "samples": Key(COUNT, None, "run length in trained samples (rounded up to whole steps)"),
        "seed": Key(Int(low=0), 0, "random seed"),
        "eval_every": Key(Int(low=0), 0, "held-out evaluation every N steps (0: only `eval_at_start` and "
                                         "`eval_at_end`)"),
        "eval_at_start": Key(Bool(), RunPlan.eval_at_start, "evaluate the weights before the first step"),
        "eval_at_end": Key(Bool(), RunPlan.eval_at_end, "evaluate the last step's weights, also off the "
                                                        "`eval_every` grid"),
        "eval_timeout": Key(DURATION, 0.0, "longest a held-out evaluation may take from its request; one that "
                                           "overruns is reported as timed out, the run goes on (0: no limit)"),
        "checkpoint_every": Key(Int(low=0), 0, "checkpoint every N steps (0: only on stop)"),
        "keep_checkpoints": Key(Int(low=0), 0, "complete checkpoints kept, the newest; older ones are deleted "
                                               "(0: keep all)"),
        "watchdog": Key(DURATION, 120.0, "stop with a report when no pump progresses this long"),
        "restarts": Key(Int(low=0), RunPlan.restarts, "times a lost trainer rank is restarted, with every actor, "
                                                      "from the last checkpoint before the run gives up"),
        "log": Key(ListOf(Enum(("tensorboard", "wandb", "mlflow"))), ["tensorboard"],
                   "where step metrics go besides metrics.jsonl: `tensorboard`, `wandb`, `mlflow` (`[]`: none)"),
    },
}

NAMED_BLOCKS = ("model", "dataset", "environment")  # `model NAME { }`
SINGLE_BLOCKS = ("staleness", "buffer", "placement", "run")  # at most one per pipeline
STAGE_KINDS = tuple(STAGE_KEYS)
BLOCK_KINDS = ("cluster", "stage", *NAMED_BLOCKS, *SINGLE_BLOCKS)


def can_sleep(engine: EngineSpec) -> bool:
    arg = ENGINES[engine.name].can_sleep_arg
    return bool(arg and engine.args.get(arg))
