"""What `rldsl run` would refuse before it starts, found by `check` with the
launcher's own predicates (rldsl/launch_rules.py): an engine that loads a
Hugging Face checkpoint, or a chat template, on a model that is none
(RLP112); `top_p = 0`, a vLLM temperature above 2 and a `min_new_tokens` above
`max_new_tokens` (RLP106); a loss `clip` of 1 (RLP312); a sim
generator asked for text (RLP116); a logprob stage on GPUs another
pipeline shares (RLP513). Each finding is the launcher's refusal, with its
caret on the setting that causes it. Responses past the builtin model's
context are cut to fit in the plan, with a warning where the file wrote
them (RLP117), so the launcher never meets them."""

from __future__ import annotations

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl
from rldsl.compiler.diagnostics import ERROR, WARNING, Diagnostic
from rldsl.compiler.schema import ENGINES
from rldsl.compiler.types import arg_span
from rldsl.launch_rules import (
    BUILTIN_CONTEXT, BUILTIN_CONTEXTS, BUILTIN_TINY, UNKNOWN_PROMPT_TOKENS, chat_template_refusal,
    checkpoint_refusal, clip_refusal, context_refusal, longest_prompt, min_tokens_refusal, response_limit,
    shared_logprob_refusal, temperature_refusal, textless_refusal, top_p_refusal,
)
from rldsl.plan import evaluates_held_out


def _source(ctx: Context, stage: Decl) -> str | None:
    """The stage's model's `source`, when both resolved."""
    ref = stage.get("model") if stage.valid("model") else None
    model = ctx.pipe.models.get(ref.name) if ref is not None else None
    return model["source"] if model is not None and model.valid("source") else None


def check_checkpoints(ctx: Context) -> list[Diagnostic]:
    """RLP112: vllm, sglang and megatron on a builtin model; a chat template on one."""
    out = []
    for stage in ctx.pipe.stages.values():
        engine = stage.engine_name
        serves = engine is not None and stage.stage_kind in ENGINES[engine].stage_kinds  # else RLP108's
        why = serves and checkpoint_refusal(engine, _source(ctx, stage))
        if why:
            engine = stage["engine"]
            out.append(Diagnostic("RLP112", ERROR, f"{ctx.label(stage.name)}: {why}",
                                  engine.name_span or stage.span_of("engine"),
                                  notes=(f"`rldsl run` stops when the engine starts: {engine.name} reads the model's "
                                         "config, weights and tokenizer from a Hugging Face directory",),
                                  help=f"use `engine = torch` for {BUILTIN_TINY}, or a model "
                                       '`source = "hf:<local path>"`',
                                  edit=(stage.span_of("engine"), "torch")))
    for model in ctx.pipe.models.values():
        why = model.valid("source", "chat_template") and chat_template_refusal(model["source"],
                                                                                model["chat_template"])
        if why:
            out.append(Diagnostic("RLP112", ERROR, f"model `{model.name}`: {why}", model.span_of("chat_template"),
                                  help="remove `chat_template` (the builtin model reads prompts as written), or use "
                                       "an `hf:` model whose tokenizer has a template",
                                  edit=(model.span_of("chat_template"), "false")))
    return out


def check_top_p(ctx: Context) -> list[Diagnostic]:
    """RLP106: `top_p = 0`, which every engine refuses."""
    return [Diagnostic("RLP106", ERROR, f"{ctx.label(gen.name)}: {why}", gen.span_of("top_p"),
                       help="write a share above 0, such as `0.95` (`1.0`: every token; for greedy decoding "
                            "set `temperature = 0`)")
            for gen in ctx.pipe.stages_of("generate") if gen.valid("top_p")
            for why in [top_p_refusal(gen["top_p"])] if why]


def check_temperature(ctx: Context) -> list[Diagnostic]:
    """RLP106: a temperature the stage's engine refuses (vLLM: above 2)."""
    return [Diagnostic("RLP106", ERROR, f"{ctx.label(gen.name)}: {why}", gen.span_of("temperature"),
                       help="sample at `temperature = 2.0` or below (1.0: the model's own distribution)")
            for gen in ctx.pipe.stages_of("generate") if gen.valid("temperature")
            for why in [temperature_refusal(gen.engine_name, gen["temperature"])] if why]


def check_min_tokens(ctx: Context) -> list[Diagnostic]:
    """RLP106: a `min_new_tokens` above the stage's `max_new_tokens`."""
    return [Diagnostic("RLP106", ERROR, f"{ctx.label(gen.name)}: {why}", gen.span_of("min_new_tokens"),
                       help=f"hold responses to at most `max_new_tokens = {gen['max_new_tokens']}` tokens, or "
                            "raise `max_new_tokens`",
                       edit=(gen.span_of("min_new_tokens"), str(gen["max_new_tokens"])))
            for gen in ctx.pipe.stages_of("generate") if gen.valid("min_new_tokens", "max_new_tokens")
            for why in [min_tokens_refusal(gen["min_new_tokens"], gen["max_new_tokens"])] if why]


def check_clip(ctx: Context) -> list[Diagnostic]:
    """RLP312: a loss `clip` of 1 (100%), which every trainer refuses."""
    train = ctx.train_stage()
    loss = train["loss"] if train is not None and train.valid("loss") else None
    why = loss is not None and clip_refusal(loss.args.get("clip", 0.2))
    if not why:
        return []
    return [Diagnostic("RLP312", ERROR, f"{ctx.label(train.name)}: {why}", arg_span(loss, "clip"),
                       help="clip the ratio within a share below 1, such as `clip = 0.2` (PPO's and GRPO's usual)",
                       edit=(arg_span(loss, "clip"), "clip = 0.2"))]


def check_text(ctx: Context) -> list[Diagnostic]:
    """RLP116: an environment, or evaluation on the generators, with a sim generator."""
    out = []
    evaluation = _generator_evaluation(ctx)
    for gen in ctx.pipe.stages_of("generate"):
        engine = gen.engine_name
        if gen.valid("environment") and gen.get("environment") is not None:
            why = textless_refusal(engine, f"the environment `{gen['environment'].name}`")
            if why:
                out.append(_textless(ctx, gen, why, gen.span_of("environment"), (gen.span_of("engine"), "torch"),
                                     "use `engine = torch` (or vllm, sglang on an `hf:` model): an environment talks "
                                     "to the model in text"))
        if evaluation is not None:
            why = textless_refusal(engine, "held-out evaluation on the generators (`eval_on = generators`)")
            if why:
                out.append(_textless(ctx, gen, why, evaluation.span_of("eval_on"),
                                     (evaluation.span_of("eval_on"), "evaluator"),
                                     "set `eval_on = evaluator` (a CPU copy of the policy decodes), or `eval_size = "
                                     "0`"))
    return out


def _textless(ctx: Context, gen: Decl, why: str, span, edit, help_text: str) -> Diagnostic:
    return Diagnostic("RLP116", ERROR, f"{ctx.label(gen.name)}: {why}", span,
                      notes=("a sim generator draws token ids at calibrated latencies; it has no model to talk to or "
                             "evaluate",), help=help_text, edit=edit)


def _generator_evaluation(ctx: Context) -> Decl | None:
    """The dataset asking for held-out evaluation on the generators, when the run evaluates (as the plan's
    `evaluates` decides: a trainer with weights, a generator, prompts to evaluate, an evaluation asked for)."""
    datasets, run, train = list(ctx.pipe.datasets.values()), ctx.pipe.block("run"), ctx.train_stage()
    first = datasets[0] if datasets else None
    if first is None or train is None or not first.valid("eval_on", "eval_size") or first["eval_on"] != "generators" \
            or train.engine_name is None or not run.valid("eval_every", "eval_at_start", "eval_at_end"):
        return None
    asks = bool(run["eval_every"] or run["eval_at_start"] or run["eval_at_end"])
    evaluates = evaluates_held_out(train.engine_name, bool(ctx.pipe.stages_of("generate")), first["eval_size"], asks)
    return first if evaluates else None


def check_context(ctx: Context) -> list[Diagnostic]:
    """RLP117: a `max_new_tokens` written past what the builtin model's context holds after the longest
    prompt: the plan cuts it to fit (``response_cap``; left out, it is cut silently), since a response
    that reached it would stop the run. Prompts that fill the context leave no room at all (RLP106). An
    environment's episodes are RLP601's."""
    out = []
    for gen in ctx.pipe.stages_of("generate"):
        limit = _response_limit(ctx, gen)
        if limit is None or gen["max_new_tokens"] <= limit:
            continue
        if limit < 1:
            out.append(_no_room(ctx, gen))
        elif gen.explicit("max_new_tokens"):
            why = context_refusal(_source(ctx, gen), gen.engine_name, _longest_prompt(ctx), gen["max_new_tokens"])
            out.append(Diagnostic(
                "RLP117", WARNING, f"{ctx.label(gen.name)}: responses are cut at {limit} tokens: {why}",
                gen.span_of("max_new_tokens"),
                notes=(f"a longer sequence would fail the model's forward (in the generator, a logprob stage or "
                       f"the trainer) and stop the run, so the plan holds `max_new_tokens = {limit}`",),
                help=f"write `max_new_tokens = {limit}` (or less), which is what runs",
                edit=(gen.span_of("max_new_tokens"), str(limit))))
    return out


def _no_room(ctx: Context, gen: Decl) -> Diagnostic:
    """RLP106 on the `max_prompt_tokens` whose prompts fill the model's whole context."""
    dataset = max((d for d in ctx.pipe.datasets.values() if d.get("max_prompt_tokens")),
                  key=lambda d: d["max_prompt_tokens"])
    context = BUILTIN_CONTEXTS.get(_source(ctx, gen), BUILTIN_CONTEXT)
    return Diagnostic("RLP106", ERROR, f"`max_prompt_tokens = {dataset['max_prompt_tokens']}` leaves no room for a "
                      f"response of {ctx.label(gen.name)}: {_source(ctx, gen)} has {context} positions, "
                      "prompt and response together", dataset.span_of("max_prompt_tokens"),
                      help=f"keep `max_prompt_tokens` below {context}, with room for the answers")


def response_cap(ctx: Context, gen: Decl) -> int | None:
    """What a `max_new_tokens` past the model's context becomes in the plan: what the context holds after
    the longest prompt (None: it fits, or no limit is known)."""
    limit = _response_limit(ctx, gen)
    return limit if limit is not None and 1 <= limit < gen["max_new_tokens"] else None


def _response_limit(ctx: Context, gen: Decl) -> int | None:
    """The longest response the generator's model holds after the longest prompt, when the file shows one
    and the stage is not an environment's (an episode's context is RLP601's)."""
    prompt = _longest_prompt(ctx)
    if prompt is None or gen.stage_kind != "generate" or not gen.valid("max_new_tokens", "environment", "engine") \
            or gen.get("environment") is not None:
        return None
    source = _source(ctx, gen)
    return response_limit(source, gen.engine_name, prompt) if source else None


def _longest_prompt(ctx: Context) -> int | None:
    """The longest prompt of the pipeline's datasets, as `longest_prompt` counts it (None: one did not resolve)."""
    lengths = []
    for dataset in ctx.pipe.datasets.values():
        if not dataset.valid("source", "sources", "max_prompt_tokens"):
            return None
        sources = dataset.get("sources") or ([dataset["source"]] if dataset.get("source") else [])
        lengths.append(longest_prompt(sources, dataset.get("max_prompt_tokens", 0)))
    return max(lengths, default=UNKNOWN_PROMPT_TOKENS)


def check_shared_logprob(ctx: Context) -> list[Diagnostic]:
    """RLP513: a logprob stage on a GPU another pipeline of the file uses."""
    placement = ctx.placement
    if placement is None:
        return []
    others = {gpu for (pipeline, _), placed in placement.stages.items() if pipeline != ctx.pipe.name
              for gpu in placed.gpus}
    out = []
    for stage in ctx.pipe.stages_of("logprob"):
        placed = placement.of(ctx.pipe.name, stage.name)
        overlap = sorted(set(placed.gpus) & others) if placed else []
        if overlap:
            gpu = overlap[0]
            key = "colocate" if stage.explicit("colocate") else "gpus"
            out.append(Diagnostic(
                "RLP513", ERROR, shared_logprob_refusal(ctx.label(stage.name), placement.node_of(gpu),
                                                        placement.local(gpu)),
                stage.span_of(key),
                notes=("pipelines take turns on a shared GPU through leases; a logprob stage there would score "
                       "while another pipeline's stage holds the GPU",),
                help="give the logprob stage GPUs no other pipeline uses, or colocate it with its own pipeline's "
                     "trainer there"))
    return out


PASSES = (check_checkpoints, check_top_p, check_temperature, check_min_tokens, check_clip, check_text, check_context)
PLACED_PASSES = (check_shared_logprob,)
