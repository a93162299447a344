"""Reward stages that score with a reward model (RLP107, RLP113-RLP115): a
stage scores with something, judge settings come with a model, the model
can do what `judge` asks, and held-out evaluation can score without it."""

from __future__ import annotations

import json
from pathlib import Path

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl
from rldsl.compiler.diagnostics import ERROR, Diagnostic
from rldsl.compiler.schema import JUDGE_KEYS

GENERATE_ONLY = ("template", "parse", "max_new_tokens")  # mean nothing to a `score` judge
SCORE_ENGINES = ("torch",)  # engines that run a sequence-classification model
CLASSIFIER_SUFFIX = "ForSequenceClassification"


def check_reward_sources(ctx: Context) -> list[Diagnostic]:
    """RLP107: a reward stage with neither `fn` nor `model`; RLP113: judge
    settings without a model, or generation settings on a `score` judge;
    RLP102: a function component named like the stage (the model's component)."""
    out = []
    for stage in ctx.pipe.stages_of("reward"):
        if not stage.valid("fn", "model"):
            continue
        label = ctx.label(stage.name)
        if not stage.get("model"):
            if stage.get("fn") is None:
                out.append(Diagnostic("RLP107", ERROR, f"reward stage {label} is missing `fn`", stage.name_span,
                                      help='add `fn = "module:function"` (for example "rldsl.rewards:exact_match"),'
                                           " or score with a reward model, `model = NAME`"))
            out += [_without_model(stage, key, label) for key in JUDGE_KEYS if stage.explicit(key)]
            continue
        if stage.valid("judge") and stage["judge"] == "score":
            out += [_not_for_score(stage, key, label) for key in GENERATE_ONLY if stage.explicit(key)]
        clash = next((c for c in stage.get("fn") or () if getattr(c, "name", None) == stage.name), None)
        if clash is not None:
            out.append(Diagnostic("RLP102", ERROR, f"reward component `{stage.name}` has the name of its stage, "
                                  "which names the reward model's component", clash.span,
                                  help="rename the component: each is logged as `reward/<name>`"))
    return out


def _without_model(stage: Decl, key: str, label: str) -> Diagnostic:
    return Diagnostic("RLP113", ERROR, f"reward stage {label} sets `{key}` but scores with no reward model",
                      stage.span_of(key), help=f"add `model = NAME` (the reward model), or remove `{key}`: "
                                               "without a model the stage runs `fn` on CPU workers")


def _not_for_score(stage: Decl, key: str, label: str) -> Diagnostic:
    return Diagnostic("RLP113", ERROR, f"reward stage {label} sets `{key}`, which only a generating judge reads, "
                      "but its model scores (`judge = score`)", stage.span_of(key),
                      help=f"write `judge = generate` for a model that answers a judge prompt, or remove `{key}`")


def check_judge_model(ctx: Context) -> list[Diagnostic]:
    """RLP114: a `score` judge needs an `hf:` sequence-classification model
    with one label (read from its config.json when there is one) on the
    torch engine; a `generate` judge needs a model that generates."""
    out = []
    base_dir = Path(ctx.program.filename).parent
    for stage in ctx.pipe.stages_of("reward"):
        model = _model(ctx, stage)
        if model is None or not stage.valid("judge", "engine"):
            continue
        problem = _judge_problem(stage, model, base_dir)
        if problem:
            message, span, fix = problem
            out.append(Diagnostic("RLP114", ERROR, f"reward stage {ctx.label(stage.name)}: {message}", span,
                                  help=fix))
    return out


def _judge_problem(stage: Decl, model: Decl, base_dir: Path):
    source, judge, engine = model["source"], stage["judge"], stage["engine"].name
    config = _hf_config(source, base_dir)
    architectures = [str(a) for a in (config or {}).get("architectures") or ()]
    classifier = any(a.endswith(CLASSIFIER_SUFFIX) for a in architectures)
    if judge == "generate":
        if architectures and all(a.endswith(CLASSIFIER_SUFFIX) for a in architectures):
            return (f"model `{model.name}` is a classifier ({architectures[0]}) and cannot answer a judge prompt",
                    stage.span_of("judge"), "write `judge = score` to use its logit as the reward")
        return None
    if engine not in SCORE_ENGINES:
        return (f"engine `{engine}` cannot run a sequence-classification reward model (`judge = score`)",
                stage.span_of("engine"), "use `engine = torch`, or `judge = generate` for vLLM")
    if not source.startswith("hf:"):
        return (f"`judge = score` needs a Hugging Face sequence-classification model, and `{model.name}` is "
                f"{source}", stage.span_of("model"),
                "name an `hf:` reward model, or write `judge = generate` to have this model answer a judge prompt")
    if config is None:
        return None  # unreadable here: `rldsl run` loads it and says what is wrong
    if not classifier:
        shown = architectures[0] if architectures else "no `architectures`"
        return (f"model `{model.name}` is not a sequence classifier ({shown} in its config.json)",
                stage.span_of("model"), "use an `AutoModelForSequenceClassification` checkpoint with one label, or "
                                        "write `judge = generate` for a causal LM")
    labels = _labels(config)
    if labels != 1:
        return (f"model `{model.name}` has {labels} labels; a reward model has one (its logit is the reward)",
                stage.span_of("model"), "use a reward model saved with `num_labels = 1`")
    return None


def _labels(config: dict) -> int:
    if "num_labels" in config:
        return int(config["num_labels"])
    return len(config.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"})  # transformers' default is two


def _hf_config(source: str, base_dir: Path) -> dict | None:
    if not source.startswith("hf:"):
        return None
    path = Path(source.removeprefix("hf:"))
    try:
        config = json.loads(((path if path.is_absolute() else base_dir / path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _model(ctx: Context, stage: Decl) -> Decl | None:
    model = ctx.pipe.model_of(stage)
    return model if model is not None and model.valid("source") else None


def check_evaluation(ctx: Context) -> list[Diagnostic]:
    """RLP115: held-out evaluation scoring with the pipeline's reward, which a reward model is part of."""
    judged = sorted(s.name for s in ctx.pipe.stages_of("reward") if s.valid("model") and s.get("model"))
    if not judged:
        return []
    out = []
    for dataset in ctx.pipe.datasets.values():
        if dataset.valid("eval_metric", "eval_size") and dataset["eval_metric"] == "reward" \
                and dataset["eval_size"] > 0:
            out.append(Diagnostic(
                "RLP115", ERROR, f"dataset `{dataset.name}` evaluates with the pipeline's reward, which includes the "
                f"reward model of {ctx.label(judged[0])}", dataset.span_of("eval_metric"),
                notes=("held-out evaluation scores on the CPU beside training, with reward functions only",),
                help='set `eval_metric = "module:function"` (such as "rldsl.rewards:exact_match"), or '
                     "`eval_size = 0`"))
    return out


PASSES = (check_reward_sources, check_judge_model, check_evaluation)
