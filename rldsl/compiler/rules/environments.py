"""Multi-turn environments (RLP601-RLP608): budgets that fit the model's
context, environments and tools that are used and exist, a reward that is
the episode's, a loss mask that is the environment's, and a hang cut that
spares healthy calls."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl
from rldsl.compiler.diagnostics import ERROR, WARNING, Diagnostic
from rldsl.launch_rules import BUILTIN_CONTEXT, BUILTIN_CONTEXTS
from rldsl.plan import EPISODE_REWARD_FN

TINY_CONTEXT = BUILTIN_CONTEXT  # rldsl.models.tiny.TinyLMConfig.max_positions (a test keeps them equal)
LIMITED_ENGINES = ("vllm", "sglang")  # engines whose `max_model_len` bounds a conversation
BUILTIN_ENVIRONMENTS = "rldsl.environments"
# Below this `straggler` factor healthy calls are cut: a call a few times the moving average is ordinary variation.
STRAGGLER_AT_LEAST = 4


def _users(ctx: Context) -> list[tuple[Decl, Decl]]:
    """(generate stage, its environment) for each generate stage with a valid one."""
    pairs = []
    for gen in ctx.pipe.stages_of("generate"):
        ref = gen.get("environment") if gen.valid("environment") else None
        if ref is not None and ref.name in ctx.pipe.environments:
            pairs.append((gen, ctx.pipe.environments[ref.name]))
    return pairs


def check_budgets(ctx: Context) -> list[Diagnostic]:
    """RLP601: a conversation past the model's context; RLP602: turns the budget cannot hold."""
    out = []
    for gen, env in _users(ctx):
        if not gen.valid("max_new_tokens") or not env.valid("max_turns", "max_tokens"):
            continue
        turn, turns, budget = gen["max_new_tokens"], env["max_turns"], env["max_tokens"]
        context = _context(ctx, gen)
        if context is not None:
            limit, what = context
            prompt = _prompt_tokens(ctx)
            longest = prompt + budget + turn
            if longest > limit:
                prompt_text = f"{prompt} (`max_prompt_tokens`) + " if prompt else ""
                out.append(Diagnostic(
                    "RLP601", ERROR, f"an episode of {ctx.label(gen.name)} may outgrow {what} ({limit} tokens): "
                    f"{prompt_text}{budget} (`max_tokens` of `{env.name}`) + {turn} (`max_new_tokens`, the "
                    f"last turn) = {longest}{'' if prompt else ', and the prompt'}", env.span_of("max_tokens"),
                    notes=("each turn reads the whole conversation so far, so the last one starts from the prompt "
                           "and up to `max_tokens` of response",),
                    help=f"lower `max_tokens` to at most {max(1, limit - prompt - turn)}, or `max_new_tokens`"))
        if turns * turn > budget:
            out.append(Diagnostic(
                "RLP602", WARNING, f"`{env.name}` allows {turns} turns of up to {turn} tokens "
                f"(`max_new_tokens` of {ctx.label(gen.name)}), {turns * turn} in all, but an episode's response "
                f"holds {budget} (`max_tokens`), the environment's tokens included", env.span_of("max_tokens"),
                notes=("an episode that reaches `max_tokens` ends there, its last turn cut short",),
                help=f"raise `max_tokens` to at least {turns * turn} plus the environment's answers, or lower "
                     "`max_turns` or `max_new_tokens`"))
    return out


def _context(ctx: Context, gen: Decl) -> tuple[int, str] | None:
    """The generator's context limit and how to name it, where the language knows it."""
    engine = gen.get("engine") if gen.valid("engine") else None
    if engine is not None and engine.name in LIMITED_ENGINES and engine.args.get("max_model_len"):
        return int(engine.args["max_model_len"]), f"`max_model_len` of {ctx.label(gen.name)}"
    model = ctx.pipe.models.get(gen["model"].name) if gen.valid("model") and gen.get("model") else None
    if model is not None and model.valid("source") and model["source"] in BUILTIN_CONTEXTS:
        return BUILTIN_CONTEXTS[model["source"]], f"the context of {model['source']}"
    return None


def _prompt_tokens(ctx: Context) -> int:
    """The datasets' `max_prompt_tokens`, where every one sets it (else 0: the bound is then a lower one)."""
    limits = [d.get("max_prompt_tokens", 0) for d in ctx.pipe.datasets.values() if d.valid("max_prompt_tokens")]
    return max(limits) if limits and all(limits) else 0


def check_use(ctx: Context) -> list[Diagnostic]:
    """RLP603: an environment no generate stage uses; RLP604: `fn` or a tool names nothing importable;
    RLP607: tools whose calls are never read."""
    used = {env.name for _, env in _users(ctx)}
    out = []
    for env in ctx.pipe.environments.values():
        if env.name not in used and all(g.valid("environment") for g in ctx.pipe.stages_of("generate")):
            gens = sorted(g.name for g in ctx.pipe.stages_of("generate"))
            out.append(Diagnostic("RLP603", WARNING, f"environment `{env.name}` is used by no generate stage",
                                  env.name_span, help=f"add `environment = {env.name}` to "
                                                      f"`{gens[0] if gens else 'a generate stage'}`, or remove it"))
        base_dir = Path(ctx.program.filename).parent
        problem = _missing(env["fn"], base_dir, "environment class") if env.valid("fn") else None
        if problem:
            out.append(Diagnostic("RLP604", ERROR, f"environment `{env.name}`: {problem}", env.span_of("fn"),
                                  help="name an importable `module:Class`; a module beside the pipeline file is "
                                       "found there"))
        for tool in env["tools"] if env.valid("tools") else ():
            if problem := _missing(tool, base_dir, "tool"):
                out.append(Diagnostic("RLP604", ERROR, f"environment `{env.name}`: {problem}", env.span_of("tools"),
                                      help="name an importable `module:function`; a module beside the pipeline "
                                           "file is found there"))
        if env.valid("tools", "tool_format") and env["tools"] and env["tool_format"] == "none":
            out.append(Diagnostic("RLP607", WARNING, f"environment `{env.name}` offers tools, but with "
                                  "`tool_format = none` the model's calls are never read", env.span_of("tools"),
                                  help="set `tool_format` to the model's own format (`hermes` for Qwen and Hermes "
                                       "models, `pythonic` for Llama 3.2 and 4)"))
    return out


def _missing(spec: str, base_dir: Path, kind: str) -> str | None:
    """Why ``module:Name`` cannot be loaded, as far as telling needs no user code run."""
    module, _, name = spec.partition(":")
    if module == BUILTIN_ENVIRONMENTS:  # ours imports nothing heavy: look the name up
        import rldsl.environments as builtin

        known = builtin.ENVIRONMENTS if kind == "environment class" else builtin.TOOLS
        if name in known:
            return None
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean `{close[0]}`?" if close else f"it has {', '.join(known)}"
        return f"{BUILTIN_ENVIRONMENTS} has no {kind} `{name}` ({hint})"
    top = module.split(".")[0]
    try:
        found = (base_dir / f"{top}.py").is_file() or (base_dir / top).is_dir() or \
            importlib.util.find_spec(top) is not None
    except (ImportError, ValueError, OSError):  # OSError: a name too long for a file
        found = False
    return None if found else f"no module `{top}` is installed, on PYTHONPATH, or beside the pipeline file"


def check_reward(ctx: Context) -> list[Diagnostic]:
    """RLP605: the reward of an environment's samples must be the episode's."""
    out = []
    for gen, env in _users(ctx):
        for reward in ctx.pipe.stages_of("reward"):
            if gen.name in ctx.upstream(reward.name) and reward.valid("fn") and reward["fn"] != EPISODE_REWARD_FN:
                out.append(Diagnostic(
                    "RLP605", ERROR, f"reward stage {ctx.label(reward.name)} scores the transcripts of "
                    f"{ctx.label(gen.name)}, whose samples are episodes of `{env.name}`", reward.span_of("fn"),
                    notes=("an episode's reward is the sum its environment gave; a sample whose episode failed "
                           "(its environment raised, hung or died) has none and must be dropped, not scored",),
                    help=f'use `fn = "{EPISODE_REWARD_FN}"`', edit=(reward.span_of("fn"), f'"{EPISODE_REWARD_FN}"')))
    return out


def check_episode_evaluation(ctx: Context) -> list[Diagnostic]:
    """RLP609: episodes evaluated on the generators (they are played on the evaluator)."""
    if not list(_users(ctx)):
        return []
    out = []
    for dataset in ctx.pipe.datasets.values():
        if not (dataset.valid("eval_metric", "eval_size", "eval_on") and dataset["eval_size"] > 0
                and dataset["eval_on"] == "generators"):
            continue
        metric = dataset["eval_metric"]
        if metric == EPISODE_REWARD_FN or (metric == "reward" and _rewards_are_episodes(ctx)):
            out.append(Diagnostic(
                "RLP609", ERROR, f"dataset `{dataset.name}` evaluates episodes (its metric is their reward) on "
                "the generators", dataset.span_of("eval_on"),
                notes=("an episode's evaluation plays each held-out prompt in the environment on the evaluator's "
                       "copy of the policy",),
                help='remove `eval_on = generators`, or score first turns with `eval_metric = "module:function"`',
                edit=(dataset.span_of("eval_on"), "evaluator")))
    return out


def _rewards_are_episodes(ctx: Context) -> bool:
    rewards = [r for r in ctx.pipe.stages_of("reward") if r.valid("fn")]
    return bool(rewards) and all(r["fn"] == EPISODE_REWARD_FN for r in rewards)


def check_truncation(ctx: Context) -> list[Diagnostic]:
    """RLP606: `truncated = mask` judges single responses; an episode's turns are cut by its own budgets."""
    out = []
    for gen, env in _users(ctx):
        if gen.valid("truncated") and gen.get("truncated") == "mask":
            out.append(Diagnostic(
                "RLP606", ERROR, f"{ctx.label(gen.name)} sets `truncated = mask`, but its samples are episodes of "
                f"`{env.name}`", gen.span_of("truncated"),
                notes=("`truncated = mask` leaves a response cut at `max_new_tokens` out of the loss; an episode's "
                       "loss mask is its environment's, and its turns end by `max_turns` and `max_tokens`",),
                help="remove `truncated = mask` (or the environment)", edit=(gen.span_of("truncated"), "train")))
    return out


def check_straggler(ctx: Context) -> list[Diagnostic]:
    """RLP608: a `straggler` factor so low that calls of ordinary length are taken for hung."""
    owners = [(f"environment `{env.name}`", env) for env in ctx.pipe.environments.values()]
    owners += [(f"reward stage {ctx.label(stage.name)}", stage) for stage in ctx.pipe.stages_of("reward")]
    out = []
    for label, decl in owners:
        if decl.valid("straggler") and 0 < decl["straggler"] < STRAGGLER_AT_LEAST:
            out.append(Diagnostic(
                "RLP608", WARNING, f"{label} takes a call for hung once it runs {decl['straggler']:g} times the "
                "usual time: healthy calls run that long", decl.span_of("straggler"),
                notes=("the usual time is a moving average, and calls vary around it: a cut this close drops "
                       "healthy samples, the longer ones first",),
                help=f"set `straggler` to {STRAGGLER_AT_LEAST} or more (8 keeps a hang's cost near the usual "
                     "time), or to 0 to cut only at `timeout`"))
    return out


PASSES = (check_budgets, check_use, check_reward, check_episode_evaluation, check_truncation, check_straggler)
