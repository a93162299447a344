"""Build the engine a stage plan names: torch or sim, on this process.

Only the runtime imports this (torch is imported here); the compiler has
already checked that the engine serves the stage kind.
"""

from __future__ import annotations

from rldsl.plan import LoraPlan, ModelPlan, PipelinePlan, StagePlan


class EngineUnavailable(RuntimeError):
    """The plan names an engine this installation cannot run here."""


def _task_of(pipe: PipelinePlan) -> str | None:
    sources = [d.source for d in pipe.datasets if d.source.startswith("builtin:")]
    return sources[0] if sources else None


def load_policy(model: ModelPlan, pipe: PipelinePlan, seed: int, adapters: bool = True):
    """The model a stage starts from, with the model's LoRA adapters if it
    declares them (``adapters``; a frozen reference is the base alone). A
    builtin model on a builtin task starts from the cached supervised warm
    start (docs/runtime.md), so RL has something to improve within minutes
    on a CPU."""
    loaded = _load_base(model, pipe, seed)
    if model.lora is not None and adapters:
        from rldsl.models.lora import add_lora

        add_lora(loaded, model.lora, seed)
    return loaded


def _load_base(model: ModelPlan, pipe: PipelinePlan, seed: int):
    from rldsl.models import BUILTIN_AGENT, BUILTIN_TINY, TINY_GPT2, load_model

    if model.source == TINY_GPT2:  # in its GPT-2 form, as the other engines load it
        loaded = load_model(f"hf:{builtin_model_dir(model, pipe, seed)}")
        loaded.source = TINY_GPT2
        return loaded
    task = _task_of(pipe) if model.source in (BUILTIN_TINY, BUILTIN_AGENT) else None
    if task is None:
        return load_model(model.source, seed=seed)
    if model.source == BUILTIN_AGENT:
        from rldsl.runtime.engines.torch.agent_warmstart import load_warm_started_agent

        return load_warm_started_agent(task, seed=seed)
    from rldsl.runtime.engines.torch.warmstart import load_warm_started

    return load_warm_started(task, seed=seed)


def builtin_model_dir(model: ModelPlan, pipe: PipelinePlan, seed: int) -> str:
    """``builtin:tiny-gpt2``'s Hugging Face directory: warm-started on the
    pipeline's builtin task (cached), as every engine loads it by path."""
    from rldsl.runtime.engines.torch.warmstart import warm_started_dir

    return str(warm_started_dir(_task_of(pipe), seed))


def _sim_latency(stage: StagePlan):
    from rldsl.runtime.engines.sim import Latency

    args = stage.engine.args
    return Latency.jittered(args.get("latency", 0.01), args.get("jitter", 0.0), args.get("tail", 0.0),
                            args.get("tail_factor", 1.0))


def sampling_settings(stage: StagePlan) -> dict:
    """A generate stage's sampling, as every generator engine takes it (plans
    saved before `top_k` and `stop_token_ids` existed sample as they did)."""
    settings = stage.settings
    return {"max_new_tokens": settings["max_new_tokens"], "temperature": settings["temperature"],
            "top_p": settings["top_p"], "top_k": settings.get("top_k", 0),
            "stop_token_ids": tuple(settings.get("stop_token_ids", ())),
            "min_new_tokens": settings.get("min_new_tokens", 0)}


def build_generator(stage: StagePlan, pipe: PipelinePlan, seed: int, base=None, serves: tuple = ()):
    """``base``: another pipeline's generator whose base weights this one
    shares (`served_by`): only the adapters are this pipeline's own.
    ``serves``: the LoRA plans of the pipelines this generator will serve
    (a vLLM engine makes room for their adapters)."""
    name = stage.engine.name
    if name == "sim":
        from rldsl.runtime.engines.sim import SimGenerator

        return SimGenerator(_sim_latency(stage), seed=seed, max_new_tokens=stage.settings.get("max_new_tokens", 16),
                            min_new_tokens=stage.settings.get("min_new_tokens", 0),
                            streaming=True)  # groups finish independently, as on vLLM's and SGLang's async engines
    if name == "torch":
        from rldsl.runtime.engines.torch.generate import TorchGenerator

        model = load_policy(_model(pipe, stage), pipe, pipe.run.seed)
        if base is not None:
            from rldsl.models.lora import share_base

            share_base(model.module, base.model.module)
        return TorchGenerator(model, **sampling_settings(stage))
    if name == "vllm":
        from rldsl.runtime.engines.vllm import VLLMGenerator

        options = _vllm_options(stage, _model(pipe, stage).lora, serves)
        if base is not None:
            return base.serving(pipe.name, options, **sampling_settings(stage))
        return VLLMGenerator.from_path(_hf_path(pipe, stage), options, seed=seed, **sampling_settings(stage))
    if name == "sglang":
        from rldsl.runtime.engines.sglang import SGLangGenerator

        return SGLangGenerator.from_path(_hf_path(pipe, stage), _sglang_options(stage), seed=seed,
                                         **sampling_settings(stage))
    raise _unavailable(stage)


def logprob_copy_ranks(stage: StagePlan) -> int:
    """How many ranks of a logprob stage hold one copy of its model between
    them and serve each call together: an fsdp stage's `shard` (0: all its
    ranks); 1 for every other stage (each rank serves alone)."""
    if stage.kind != "logprob" or stage.engine is None or stage.engine.name != "fsdp":
        return 1
    shard = stage.engine.args.get("shard", 1)
    return len(stage.ranks) if shard == 0 else shard


def build_logprob(stage: StagePlan, pipe: PipelinePlan, seed: int, process_group=None):
    """``process_group``: the stage's group, for an fsdp stage that shards."""
    name = stage.engine.name
    if name == "sim":
        from rldsl.runtime.engines.sim import SimLogprob

        return SimLogprob(_sim_latency(stage), seed=seed)
    if name == "torch":
        from rldsl.runtime.engines.torch.logprob import TorchLogprob

        model = load_policy(_model(pipe, stage), pipe, pipe.run.seed, adapters=not stage.settings.get("frozen"))
        return TorchLogprob(model, rows_per_forward=stage.settings.get("micro_batch"),
                            tokens_per_forward=stage.settings.get("micro_batch_tokens", 0),
                            offload=offloads_between_calls(stage), temperature=sampling_temperature(pipe))
    if name == "vllm":
        from rldsl.runtime.engines.vllm import VLLMLogprob

        if sampling_temperature(pipe) not in (0.0, 1.0):
            raise EngineUnavailable(f"stage `{stage.name}`: vLLM scores given tokens at temperature 1, and this "
                                    f"pipeline samples at {sampling_temperature(pipe):g}; use engine = torch, fsdp "
                                    "or megatron for this logprob stage")
        return VLLMLogprob.from_path(_hf_path(pipe, stage), _vllm_options(stage), seed=seed)
    if name == "sglang":
        from rldsl.runtime.engines.sglang import SGLangLogprob

        return SGLangLogprob.from_path(_hf_path(pipe, stage), _sglang_options(stage), seed=seed)
    if name == "fsdp":
        from rldsl.runtime.engines.fsdp.logprob import FsdpLogprob

        plan = _model(pipe, stage)
        if logprob_copy_ranks(stage) > 1 and plan.source.startswith("hf:"):  # each rank reads only its shards
            from rldsl.runtime.engines.fsdp.loading import meta_hf_model

            model = meta_hf_model(plan.source)
        else:
            model = load_policy(plan, pipe, pipe.run.seed)
        return FsdpLogprob(model, dtype=stage.engine.args["dtype"], shard=stage.engine.args.get("shard", 1),
                           process_group=process_group, rows_per_forward=stage.settings.get("micro_batch"),
                           tokens_per_forward=stage.settings.get("micro_batch_tokens", 0),
                           offload=offloads_between_calls(stage), temperature=sampling_temperature(pipe))
    if name == "megatron":
        from rldsl.runtime.engines.megatron.logprob import MegatronLogprob

        return MegatronLogprob.from_pretrained(_hf_path(pipe, stage), **_megatron_parallelism(stage),
                                               rows_per_forward=stage.settings.get("micro_batch"),
                                               tokens_per_forward=stage.settings.get("micro_batch_tokens", 0),
                                               seed=pipe.run.seed, offload=offloads_between_calls(stage),
                                               temperature=sampling_temperature(pipe))
    raise _unavailable(stage)


def offloads_between_calls(stage: StagePlan) -> bool:
    """A logprob stage with `offload = true` that shares its GPUs keeps its
    weights in host memory between scoring calls (torch/offload.py); alone on
    its GPUs it keeps them on the device."""
    return bool(stage.engine.args.get("offload")) and bool(stage.colocated_with)


def build_judge(stage: StagePlan, pipe: PipelinePlan, seed: int):
    """A reward stage's reward model (engines/judge.py): a scoring classifier
    (torch) or a generating judge (torch or vLLM); frozen, never synced."""
    from rldsl.runtime.engines import judge

    name, settings = stage.engine.name, stage.settings
    if settings.get("judge", "score") == "score" and name == "torch":
        return judge.ScoreJudge(_hf_path(pipe, stage), dtype=stage.engine.args.get("dtype", "fp32"),
                                rows_per_forward=settings.get("micro_batch", 8))
    if name == "torch":
        model = load_policy(_model(pipe, stage), pipe, pipe.run.seed, adapters=False)  # frozen: the base
        return judge.GenerativeJudge(model, settings["max_new_tokens"], settings.get("micro_batch", 8))
    if name == "vllm" and settings.get("judge") == "generate":
        return judge.VLLMGenerativeJudge(_hf_path(pipe, stage), _vllm_options(stage), seed, settings["max_new_tokens"])
    raise _unavailable(stage)


def trainer_exports_beside_steps(stage: StagePlan) -> bool:
    """Whether the stage's trainer may export its weights while its next
    step trains (``exports_beside_steps`` on the engine's class: no forward
    of the step's microbatches swaps the weights, and the export's
    collectives, if any, never pair with the step's)."""
    if stage.engine.name == "sim":
        from rldsl.runtime.engines.sim import SimTrainer as trainer
    elif stage.engine.name == "torch":
        from rldsl.runtime.engines.torch.train import TorchTrainer as trainer
    elif stage.engine.name == "megatron":
        from rldsl.runtime.engines.megatron.trainer import MegatronTrainer as trainer
    elif stage.engine.name == "fsdp":
        from rldsl.runtime.engines.fsdp.trainer import FsdpTrainer as trainer
    else:
        return False
    return bool(getattr(trainer, "exports_beside_steps", False))


def build_trainer(stage: StagePlan, pipe: PipelinePlan, seed: int, process_group=None):
    name = stage.engine.name
    if name == "sim":
        from rldsl.runtime.engines.sim import SimTrainer

        return SimTrainer(_sim_latency(stage), seed=seed, lr=stage.settings.get("lr", 0.0),
                          lr_schedule=lr_schedule(stage, pipe))
    if name == "torch":
        from rldsl.runtime.engines.torch.train import TorchTrainer

        model = load_policy(_model(pipe, stage), pipe, pipe.run.seed)
        return TorchTrainer(model, **training_options(stage, pipe), process_group=process_group,
                            offload=stage.engine.args.get("offload", True))
    if name == "fsdp":
        from rldsl.runtime.engines.fsdp.trainer import FsdpTrainer

        args = stage.engine.args
        plan = _model(pipe, stage)
        if plan.source.startswith("hf:"):  # parameters on meta: each rank reads only its shards of the files
            from rldsl.runtime.engines.fsdp.loading import meta_hf_model

            model = meta_hf_model(plan.source)
            if plan.lora is not None:  # on meta too: the sharded load starts them as PEFT does
                from rldsl.models.lora import add_lora

                add_lora(model, plan.lora, pipe.run.seed)
        else:
            model = load_policy(plan, pipe, pipe.run.seed)
        return FsdpTrainer(model, shard=args["shard"], dtype=args["dtype"], offload=args["offload"],
                           **training_options(stage, pipe), process_group=process_group)
    if name == "megatron":
        from rldsl.runtime.engines.megatron.trainer import MegatronTrainer

        args = stage.engine.args
        # Megatron builds its groups from the default process group (the worker's, or a
        # one-process group it creates), so `process_group` is not passed on.
        return MegatronTrainer.from_pretrained(
            _hf_path(pipe, stage), **_megatron_parallelism(stage),
            distributed_optimizer=args["distributed_optimizer"], offload=args["offload"],
            **training_options(stage, pipe), seed=pipe.run.seed)
    raise _unavailable(stage)


def training_options(stage: StagePlan, pipe: PipelinePlan) -> dict:
    """The trainer arguments a train stage's settings give (``.get`` with the
    language's defaults, so plans written before a key existed still build)."""
    settings = stage.settings
    betas = settings.get("adam_betas")  # None: the engine's own
    return {
        "loss": loss_options(settings.get("loss", {})),
        "lr": settings["lr"],
        **({"betas": tuple(betas)} if betas else {}),
        "eps": settings.get("adam_eps", 1e-8),
        "weight_decay": settings.get("weight_decay", 0.0),
        "max_grad_norm": settings.get("max_grad_norm", 1.0) or None,
        "rows_per_forward": settings.get("micro_batch") or pipe.batch.micro_batch,
        "tokens_per_forward": settings.get("micro_batch_tokens", 0),
        "lr_schedule": lr_schedule(stage, pipe),
        "temperature": sampling_temperature(pipe),
    }


def sampling_temperature(pipe: PipelinePlan) -> float:
    """The temperature the pipeline's samples are drawn at (its first
    generate stage's): every logprob of them is taken at it, the trainer's and
    the logprob stages' as the generator's (1 without a generator)."""
    generators = pipe.stages_of("generate")
    return float(generators[0].settings.get("temperature", 1.0)) if generators else 1.0


LEGACY_LOSS_LEVELS = {"token": "token_mean", "sequence": "seq_mean_token_mean"}


def loss_options(loss: dict) -> dict:
    """``PolicyLossConfig`` arguments from the plan's loss (its ``name`` is
    the family, always the clipped policy gradient); an older plan's
    ``level`` becomes the matching ``agg``."""
    options = {key: value for key, value in loss.items() if key != "name"}
    level = options.pop("level", None)
    if level is not None:
        options.setdefault("agg", LEGACY_LOSS_LEVELS[level])
    return options


def lr_schedule(stage: StagePlan, pipe: PipelinePlan):
    """The schedule over the run's optimizer steps: steps x optimizer steps
    per rollout batch (mini-batches x ppo_epochs)."""
    from rldsl.runtime.engines.schedule import LRSchedule

    settings = stage.settings
    total = pipe.run.steps * pipe.batch.optimizer_steps_per_step
    return LRSchedule(settings.get("lr_schedule", "constant"), settings.get("warmup", 0), total,
                      settings.get("min_lr", 0.0), settings.get("warmup_start_lr", 0.0))


def _model(pipe: PipelinePlan, stage: StagePlan) -> ModelPlan:
    return next(m for m in pipe.models if m.name == stage.model)


def _hf_path(pipe: PipelinePlan, stage: StagePlan) -> str:
    """The local checkpoint directory the vllm, sglang and megatron engines (and a scoring judge) load."""
    from rldsl.launch_rules import checkpoint_refusal
    from rldsl.models import TINY_GPT2

    source = _model(pipe, stage).source
    if source == TINY_GPT2:
        return builtin_model_dir(_model(pipe, stage), pipe, pipe.run.seed)
    why = checkpoint_refusal(stage.engine.name, source) or (None if source.startswith("hf:") else
                                                            f"a Hugging Face model loads from `hf:<path>`, not {source!r}")
    if why:  # `check` refuses the file for it (RLP112, RLP114): only a hand-made plan gets here
        raise EngineUnavailable(f"stage `{stage.name}`: {why}")
    return source[len("hf:"):]


def _vllm_options(stage: StagePlan, lora: LoraPlan | None = None, serves: tuple = ()):
    """A vllm stage's engine options; ``lora``: the policy's adapters, which a generator serves, beside
    those of the pipelines it ``serves``."""
    from rldsl.layout import leaves_gpus_to_workers
    from rldsl.runtime.engines.vllm import VLLMOptions

    args = stage.engine.args
    adapters = {"lora_rank": lora.rank, "lora_alpha": lora.alpha, "lora_targets": tuple(lora.targets),
                "served_lora_ranks": tuple(served.rank for served in serves)} if lora else {}
    shares = any(leaves_gpus_to_workers(stage.engine.name, len(r.gpus), r.gpu_fraction) for r in stage.ranks)
    return VLLMOptions(tp=args["tp"], pp=args.get("pp", 1), spans_nodes=any(r.remote for r in stage.ranks),
                       shares_gpus=shares,
                       gpu_memory=args["gpu_memory"], sleep=args["sleep"],
                       max_model_len=args.get("max_model_len"), dtype=args["dtype"], kv_cache=args.get("kv_cache"),
                       **adapters)


def _sglang_options(stage: StagePlan):
    from rldsl.runtime.engines.sglang import SGLangOptions

    args = stage.engine.args
    return SGLangOptions(tp=args["tp"], gpu_memory=args["gpu_memory"], sleep=args["sleep"],
                         max_model_len=args.get("max_model_len"), dtype=args["dtype"],
                         deterministic=args.get("deterministic", False))  # plans saved before it: off


def _megatron_parallelism(stage: StagePlan) -> dict:
    args = stage.engine.args
    return {"tp": args["tp"], "pp": args["pp"], "ep": args.get("ep", 1), "etp": args.get("etp"),
            "dtype": args["dtype"]}


def _unavailable(stage: StagePlan) -> EngineUnavailable:
    return EngineUnavailable(
        f"stage `{stage.name}`: engine `{stage.engine.name}` cannot run a {stage.kind} stage here")
