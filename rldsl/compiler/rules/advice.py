"""Help texts that fit the file: they name the stages that exist and say
what is missing (a flag, a flow edge, a `to` entry) before suggesting a new
declaration, and a new declaration gets a name the pipeline does not use."""

from __future__ import annotations

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl, Pipeline
from rldsl.compiler.diagnostics import Span
from rldsl.compiler.ir import token_weighting


def free_name(pipe: Pipeline, base: str) -> str:
    """``base``, or ``base2``, ``base3``... whichever the pipeline does not declare yet."""
    taken = {*pipe.models, *pipe.datasets, *pipe.stages, *pipe.ambiguous}
    if base not in taken:
        return base
    return next(f"{base}{n}" for n in range(2, len(taken) + 3) if f"{base}{n}" not in taken)


def _before(producer: str, consumer: str) -> str:
    return f"put `{producer}` in a flow before `{consumer}`: `flow ... -> {producer} -> ... -> {consumer}`"


def producer_help(ctx: Context, stage: Decl, field: str) -> str:
    """How to get ``field`` upstream of ``stage``."""
    pipe = ctx.pipe
    if field == "ref_logprobs":
        return _reference_help(ctx, stage)
    if field == "behaviour_logprobs":
        return _behaviour_help(ctx, stage)
    if field == "reward":
        rewards = sorted(s.name for s in pipe.stages_of("reward"))
        if rewards:
            return _before(rewards[0], stage.name)
        return (f"add `stage reward {free_name(pipe, 'score')} {{ fn = \"rldsl.rewards:exact_match\" }}` and put it "
                f"in the flow before `{stage.name}`")
    if field == "response_ids":
        generators = sorted(s.name for s in pipe.stages_of("generate"))
        if generators:
            return _before(generators[0], stage.name)
        return f"add a generate stage and put it in the flow before `{stage.name}`"
    if field == "episode_reward":
        envs = sorted(pipe.environments) or [free_name(pipe, "env")]
        return (f"give the generate stage before `{stage.name}` an environment (`environment = {envs[0]}`), "
                "or score the responses with another `fn`")
    datasets = sorted(pipe.datasets)
    start = datasets[0] if datasets else free_name(pipe, "prompts")
    return f"start the flow at a dataset: `flow {start} -> ... -> {stage.name}`"


def _model_of(stage: Decl) -> str | None:
    return stage["model"].name if stage.valid("model") and stage.get("model") else None


def unfrozen_reference(ctx: Context, train: Decl) -> Decl | None:
    """The logprob stage meant as the reference when the trainer's kl needs one and no stage is `frozen`:
    the first policy scorer (it then also takes no weight sync, so its RLP205 follows from this)."""
    loss = train.get("loss") if train.valid("loss") else None
    if loss is None or loss.args.get("kl", 0) <= 0:
        return None
    scorers = sorted((s for s in ctx.pipe.stages_of("logprob") if s.valid("frozen")), key=lambda s: s.name)
    return scorers[0] if scorers and not any(s.get("frozen") for s in scorers) else None


def frozen_edit(stage: Decl) -> tuple[Span, str]:
    """`frozen` added after the stage's `model` (every logprob stage writes one)."""
    at = stage.span_of("model")
    return Span(at.end_line, at.end_col, at.end_line, at.end_col), "  frozen"


def _reference_help(ctx: Context, train: Decl) -> str:
    pipe, model = ctx.pipe, _model_of(train)
    scorers = sorted((s for s in pipe.stages_of("logprob") if s.valid("frozen")), key=lambda s: s.name)
    frozen = [s for s in scorers if s.get("frozen")]
    if frozen:
        return _before(frozen[0].name, train.name) + ", or set kl = 0"
    if scorers:
        return (f"`{scorers[0].name}` scores the policy (behaviour_logprobs); a reference is a logprob stage marked "
                f"`frozen`: add `frozen` to `{scorers[0].name}` if it is the reference, or set kl = 0")
    name = free_name(pipe, "reference")
    return (f"add `stage logprob {name} {{ model = {model or 'policy'}  frozen  colocate = {train.name} }}` and put it "
            f"in the flow before `{train.name}`, or set kl = 0")


def _behaviour_help(ctx: Context, train: Decl) -> str:
    pipe = ctx.pipe
    upstream = ctx.upstream(train.name)
    quiet = sorted(s.name for s in pipe.stages_of("generate") if s.name in upstream and s.get("logprobs") is False)
    weighting = token_weighting(train.get("loss")) if train.valid("loss") else ""
    on_policy = f"or drop `{weighting}` from the loss" if weighting else "or train on-policy with max_lag = 0"
    if quiet:
        return f"remove `logprobs = false` from `{quiet[0]}`, {on_policy}"
    policy_scorers = sorted(s.name for s in pipe.stages_of("logprob") if s.valid("frozen") and not s.get("frozen"))
    if policy_scorers:
        return _before(policy_scorers[0], train.name) + f", {on_policy}"
    return f"put a generate stage with `logprobs = true` in the flow before `{train.name}`, {on_policy}"
