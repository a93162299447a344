"""Build the engine a stage plan names: torch or sim, on this process.

Only the runtime imports this (torch is imported here); the compiler has
already checked that the engine serves the stage kind.
"""

from __future__ import annotations

from rldsl.plan import ModelPlan, PipelinePlan, StagePlan


class EngineUnavailable(RuntimeError):
    """The plan names an engine this installation cannot run here."""


def _task_of(pipe: PipelinePlan) -> str | None:
    sources = [d.source for d in pipe.datasets if d.source.startswith("builtin:")]
    return sources[0] if sources else None


def load_policy(model: ModelPlan, pipe: PipelinePlan, seed: int):
    """The model a stage starts from. The builtin tiny model on a builtin task
    starts from the cached supervised warm start (docs/runtime.md), so RL has
    something to improve within minutes on a CPU."""
    from rldsl.models import BUILTIN_TINY, load_model

    task = _task_of(pipe) if model.source == BUILTIN_TINY else None
    if task is None:
        return load_model(model.source, seed=seed)
    from rldsl.runtime.engines.torch.warmstart import load_warm_started

    return load_warm_started(task, seed=seed)


def _sim_latency(stage: StagePlan):
    from rldsl.runtime.engines.sim import Latency

    args = stage.engine.args
    return Latency.jittered(args.get("latency", 0.01), args.get("jitter", 0.0), args.get("tail", 0.0),
                            args.get("tail_factor", 1.0))


def build_generator(stage: StagePlan, pipe: PipelinePlan, seed: int):
    name = stage.engine.name
    if name == "sim":
        from rldsl.runtime.engines.sim import SimGenerator

        return SimGenerator(_sim_latency(stage), seed=seed, max_new_tokens=stage.settings.get("max_new_tokens", 16))
    if name == "torch":
        from rldsl.runtime.engines.torch.generate import TorchGenerator

        model = load_policy(_model(pipe, stage), pipe, pipe.run.seed)
        return TorchGenerator(model, max_new_tokens=stage.settings["max_new_tokens"],
                              temperature=stage.settings["temperature"], top_p=stage.settings["top_p"])
    if name == "vllm":
        from rldsl.runtime.engines.vllm import VLLMGenerator

        return VLLMGenerator.from_path(_hf_path(pipe, stage), _vllm_options(stage), seed=seed,
                                       max_new_tokens=stage.settings["max_new_tokens"],
                                       temperature=stage.settings["temperature"], top_p=stage.settings["top_p"])
    raise _unavailable(stage)


def build_logprob(stage: StagePlan, pipe: PipelinePlan, seed: int):
    name = stage.engine.name
    if name == "sim":
        from rldsl.runtime.engines.sim import SimLogprob

        return SimLogprob(_sim_latency(stage), seed=seed)
    if name == "torch":
        from rldsl.runtime.engines.torch.logprob import TorchLogprob

        model = load_policy(_model(pipe, stage), pipe, pipe.run.seed)
        return TorchLogprob(model, rows_per_forward=stage.settings.get("micro_batch"))
    if name == "vllm":
        from rldsl.runtime.engines.vllm import VLLMLogprob

        return VLLMLogprob.from_path(_hf_path(pipe, stage), _vllm_options(stage), seed=seed)
    if name == "megatron":
        from rldsl.runtime.engines.megatron.logprob import MegatronLogprob

        return MegatronLogprob.from_pretrained(_hf_path(pipe, stage), **_megatron_parallelism(stage),
                                               rows_per_forward=stage.settings.get("micro_batch"), seed=pipe.run.seed)
    raise _unavailable(stage)


def build_trainer(stage: StagePlan, pipe: PipelinePlan, seed: int, process_group=None):
    name = stage.engine.name
    if name == "sim":
        from rldsl.runtime.engines.sim import SimTrainer

        return SimTrainer(_sim_latency(stage), seed=seed)
    if name == "torch":
        from rldsl.runtime.engines.torch.train import TorchTrainer

        loss = dict(stage.settings["loss"])
        loss.pop("name", None)
        model = load_policy(_model(pipe, stage), pipe, pipe.run.seed)
        return TorchTrainer(model, loss=loss, lr=stage.settings["lr"], weight_decay=stage.settings["weight_decay"],
                            max_grad_norm=stage.settings["max_grad_norm"] or None,
                            rows_per_forward=pipe.batch.micro_batch, process_group=process_group)
    if name == "megatron":
        from rldsl.runtime.engines.megatron.trainer import MegatronTrainer

        loss = dict(stage.settings["loss"])
        loss.pop("name", None)
        args = stage.engine.args
        # Megatron builds its groups from the default process group (the worker's, or a
        # one-process group it creates), so `process_group` is not passed on.
        return MegatronTrainer.from_pretrained(
            _hf_path(pipe, stage), **_megatron_parallelism(stage),
            distributed_optimizer=args["distributed_optimizer"], offload=args["offload"], loss=loss,
            lr=stage.settings["lr"], weight_decay=stage.settings["weight_decay"],
            max_grad_norm=stage.settings["max_grad_norm"] or None, rows_per_forward=pipe.batch.micro_batch,
            global_batch=pipe.batch.global_batch, seed=pipe.run.seed)
    raise _unavailable(stage)


def _model(pipe: PipelinePlan, stage: StagePlan) -> ModelPlan:
    return next(m for m in pipe.models if m.name == stage.model)


def _hf_path(pipe: PipelinePlan, stage: StagePlan) -> str:
    """The local checkpoint directory the vllm and megatron engines load."""
    source = _model(pipe, stage).source
    if not source.startswith("hf:"):
        raise EngineUnavailable(f"stage `{stage.name}`: engine `{stage.engine.name}` loads a local Hugging Face "
                                f"checkpoint (`hf:<path>`), not {source!r}")
    return source[len("hf:"):]


def _vllm_options(stage: StagePlan):
    from rldsl.runtime.engines.vllm import VLLMOptions

    args = stage.engine.args
    return VLLMOptions(tp=args["tp"], gpu_memory=args["gpu_memory"], sleep=args["sleep"],
                       max_model_len=args.get("max_model_len"), dtype=args["dtype"])


def _megatron_parallelism(stage: StagePlan) -> dict:
    args = stage.engine.args
    return {"tp": args["tp"], "pp": args["pp"], "dtype": args["dtype"]}


def _unavailable(stage: StagePlan) -> EngineUnavailable:
    return EngineUnavailable(
        f"stage `{stage.name}`: engine `{stage.engine.name}` cannot run a {stage.kind} stage here")
