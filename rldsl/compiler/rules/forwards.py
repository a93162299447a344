"""Token budgets of forwards (RLP316): a train or logprob stage's
`micro_batch_tokens` below the longest row a generator can write, where the
language knows that length."""

from __future__ import annotations

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl
from rldsl.compiler.diagnostics import WARNING, Diagnostic
from rldsl.compiler.rules.environments import LIMITED_ENGINES

BUDGETED_KINDS = ("train", "logprob")


def check_token_budgets(ctx: Context) -> list[Diagnostic]:
    """RLP316, for every train or logprob stage with a token budget."""
    longest = longest_row(ctx)
    if longest is None:
        return []
    out = []
    for stage in ctx.pipe.stages.values():
        if stage.stage_kind not in BUDGETED_KINDS or not stage.valid("micro_batch_tokens"):
            continue
        budget = stage.get("micro_batch_tokens", 0)
        if 0 < budget < longest:
            span = stage.span_of("micro_batch_tokens")
            out.append(Diagnostic(
                "RLP316", WARNING, f"{ctx.label(stage.name)} packs forwards of micro_batch_tokens = {budget}, but a "
                f"row may hold {longest} tokens", span,
                notes=("a row longer than the budget goes alone, in a forward past it: the memory bound the "
                       "budget sets does not hold for that forward",),
                help=f"set micro_batch_tokens = {longest} (or more), or bound the rows lower",
                edit=(span, str(longest))))
    return out


def longest_row(ctx: Context) -> int | None:
    """Prompt + response tokens of the longest row any generator writes; None
    when some generator's bound is unknown (or there is none)."""
    bounds = [_row_bound(ctx, gen) for gen in ctx.pipe.stages_of("generate")]
    return max(bounds) if bounds and None not in bounds else None


def _row_bound(ctx: Context, gen: Decl) -> int | None:
    """The generator's `max_model_len`, or the prompt bound plus its response
    budget, whichever is smaller; None if neither is known."""
    bounds = []
    engine = gen.get("engine") if gen.valid("engine") else None
    if engine is not None and engine.name in LIMITED_ENGINES and engine.args.get("max_model_len"):
        bounds.append(int(engine.args["max_model_len"]))
    prompt, response = _prompt_tokens(ctx), _response_tokens(ctx, gen)
    if prompt and response:
        bounds.append(prompt + response)
    return min(bounds) if bounds else None


def _prompt_tokens(ctx: Context) -> int:
    """The largest `max_prompt_tokens` of the datasets, when every one sets it (else 0: unbounded)."""
    datasets = list(ctx.pipe.datasets.values())
    if not datasets or not all(d.valid("max_prompt_tokens") and d.get("max_prompt_tokens", 0) for d in datasets):
        return 0
    return max(d["max_prompt_tokens"] for d in datasets)


def _response_tokens(ctx: Context, gen: Decl) -> int:
    """The response budget: the environment's `max_tokens`, else `max_new_tokens` (0: unknown)."""
    ref = gen.get("environment") if gen.valid("environment") else None
    if ref is not None:
        env = ctx.pipe.environments.get(ref.name)
        return env["max_tokens"] if env is not None and env.valid("max_tokens") else 0
    return gen["max_new_tokens"] if gen.valid("max_new_tokens") else 0


PASSES = (check_token_budgets,)
