"""Pipelines that would run to the end and learn nothing (RLP314), or learn
from only part of their prompts (RLP315): checked where the language knows
enough to be sure, never guessed."""

from __future__ import annotations

from fractions import Fraction

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl
from rldsl.compiler.diagnostics import ERROR, WARNING, Diagnostic, Span
from rldsl.plan import GROUP_SCALED
from rldsl.tasks import ANSWER_CHARACTERS

EXACT_MATCH = "rldsl.rewards:exact_match"
# one token per character, so answer lengths are token counts
CHARACTER_TOKENIZERS = ("builtin:tiny-lm", "builtin:tiny-agent")


def check_zero_advantages(ctx: Context) -> list[Diagnostic]:
    """RLP314: one sample per prompt, normalised by its group's spread. (A
    group baseline with one sample is RLP303's; this is the estimator that
    needs no group, made to need one by `normalize = group`.)"""
    shape = ctx.step_shape()
    if shape is None:
        return []
    train, gen = shape
    if gen["samples_per_prompt"] != 1 or not train.valid("advantage", "normalize") \
            or train["advantage"] != "reinforce_pp" or not train.explicit("normalize") \
            or train["normalize"] not in GROUP_SCALED:
        return []
    return [Diagnostic("RLP314", ERROR, f"{ctx.label(train.name)} cannot learn: with `samples_per_prompt = 1` on "
                       f"{ctx.label(gen.name)}, `normalize = {train['normalize']}` makes every advantage zero",
                       train.span_of("normalize"),
                       notes=("a one-sample group has no spread: its normalised advantage is 0, and so is the loss "
                              "on every token",),
                       help="`normalize = batch` (reinforce_pp's default) whitens over the rollout batch instead; "
                            "or sample several responses per prompt",
                       edit=(train.span_of("normalize"), "batch"))]


def check_constant_rewards(ctx: Context) -> list[Diagnostic]:
    """RLP314: `reward_scale = 0` makes every reward (reward_bias x 0 =) 0."""
    train = ctx.train_stage()
    if train is None or not train.valid("reward_scale") or train["reward_scale"] != 0:
        return []
    return [Diagnostic("RLP314", ERROR, f"{ctx.label(train.name)} cannot learn: `reward_scale = 0` makes every "
                       "reward 0", train.span_of("reward_scale"),
                       notes=("a constant reward gives every sample the same advantage: no learning signal",),
                       help="scale by a positive factor (1 leaves the rewards as scored), or leave it out",
                       edit=(train.span_of("reward_scale"), "1.0"))]


def check_difficulty_mask(ctx: Context) -> list[Diagnostic]:
    """RLP314: a difficulty mask that masks every group, for any reward (an
    empty interval) or for exact match's (no mean k/n of 0/1 rewards, n up to
    `samples_per_prompt`, lies strictly inside it)."""
    train = ctx.train_stage()
    bounds = train.get("difficulty_mask") if train is not None and train.valid("difficulty_mask") else None
    if bounds is None or len(bounds) != 2:  # off, or RLP312's
        return []
    low, high = bounds
    span = train.span_of("difficulty_mask")
    if low >= high:
        return [Diagnostic("RLP314", ERROR, f"{ctx.label(train.name)} cannot learn: `difficulty_mask = [{low:g}, "
                           f"{high:g}]` leaves no mean reward strictly between its bounds", span,
                           notes=("every prompt group is masked out of the loss",),
                           help="write the lower bound first", edit=(span, f"[{high:g}, {low:g}]"))]
    gen = ctx.generator_for(train)
    if gen is None or not gen.valid("samples_per_prompt"):
        return []
    samples = gen["samples_per_prompt"]
    if not _exact_match_only(ctx) or any(low < Fraction(k, n) < high for n in range(1, samples + 1)
                                         for k in range(n + 1)):
        return []
    return [Diagnostic("RLP314", ERROR, f"{ctx.label(train.name)} cannot learn: with exact match's 0/1 rewards and "
                       f"`samples_per_prompt = {samples}` no group's mean reward lies strictly between "
                       f"{low:g} and {high:g}", span,
                       notes=("every prompt group is masked out of the loss",),
                       help="widen the bounds around the means a group can have (k / samples_per_prompt), "
                            "sample more responses per prompt, or leave difficulty_mask out")]


def _exact_match_only(ctx: Context) -> bool:
    """Exact match is the only reward, unscaled by a reward model."""
    rewards = ctx.pipe.stages_of("reward")
    return len(rewards) == 1 and rewards[0].valid("fn") and rewards[0].get("fn") == EXACT_MATCH \
        and not rewards[0].get("model")


def check_answer_lengths(ctx: Context) -> list[Diagnostic]:
    """RLP314 when exact match can never reward (every answer is longer than
    a response may be), RLP315 when it cannot reward the longer answers."""
    known = _exact_match_on_builtin(ctx)
    if known is None:
        return []
    gen, source = known
    # `truncated = mask` trains a response only if it ended: the answer and its EOS must fit
    ending = 1 if gen.valid("truncated") and gen.get("truncated") == "mask" else 0
    shortest, longest = (n + ending for n in ANSWER_CHARACTERS[source])
    limit = gen["max_new_tokens"]
    if limit >= longest:
        return []
    span = gen.span_of("max_new_tokens") if gen.explicit("max_new_tokens") else gen.name_span
    needs = " and its end token (`truncated = mask` trains only responses that ended)" if ending else ""
    if limit < shortest:
        return [Diagnostic("RLP314", ERROR, f"{ctx.label(gen.name)} cannot be rewarded: `max_new_tokens = {limit}` "
                           f"is shorter than every answer of {source}{needs} ({shortest} to {longest} tokens)", span,
                           notes=("exact_match then scores every trained sample 0: a constant reward, no advantage, "
                                  "no learning",),
                           help=f"allow at least `max_new_tokens = {longest}`",
                           edit=_max_new_tokens_edit(gen, longest))]
    return [Diagnostic("RLP315", WARNING, f"`max_new_tokens = {limit}` is shorter than the longer answers of "
                       f"{source}{needs} (up to {longest} tokens): exact_match can never reward those prompts", span,
                       help=f"allow `max_new_tokens = {longest}`, or more", edit=_max_new_tokens_edit(gen, longest))]


def _max_new_tokens_edit(gen: Decl, tokens: int) -> tuple[Span, str]:
    """Its value replaced, or the key added after `samples_per_prompt`, which every generate stage writes."""
    if gen.explicit("max_new_tokens"):
        return gen.span_of("max_new_tokens"), str(tokens)
    at = gen.span_of("samples_per_prompt")
    return Span(at.end_line, at.end_col, at.end_line, at.end_col), f"  max_new_tokens = {tokens}"


def _exact_match_on_builtin(ctx: Context) -> tuple[Decl, str] | None:
    """(the generator, the builtin source) when the only reward is exact match
    on a builtin task generated by the character-level builtin model."""
    train = ctx.train_stage()
    gen = train and ctx.generator_for(train)
    rewards = ctx.pipe.stages_of("reward")
    if gen is None or not gen.valid("max_new_tokens", "model") or len(rewards) != 1 or not rewards[0].valid("fn"):
        return None
    model = ctx.pipe.models.get(gen["model"].name) if gen.get("model") else None
    datasets = list(ctx.pipe.datasets.values())
    if rewards[0]["fn"] != EXACT_MATCH or model is None or not model.valid("source") \
            or model["source"] not in CHARACTER_TOKENIZERS:
        return None
    if len(datasets) != 1 or not datasets[0].valid("source", "sources"):
        return None
    sources = datasets[0].get("sources") or [datasets[0].get("source")]
    if len(set(sources)) != 1 or sources[0] not in ANSWER_CHARACTERS:
        return None
    return gen, sources[0]


PASSES = (check_zero_advantages, check_constant_rewards, check_difficulty_mask, check_answer_lengths)
