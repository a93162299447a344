"""What `rldsl run` refuses before it starts anything, decided from the file
alone: `check` asks these on the declarations (compiler/rules/launch.py),
the launcher on the ExecutionPlan (``plan_refusals``, run by launch.py and
by the saved plan's re-check), so a file that checks is a file the launcher
takes. Pure: it knows neither the compiler nor the runtime.

Each predicate returns why the run would be refused, or None. What depends
on the machine that runs (a library, a GPU, a local path, a reward module)
stays in the launcher's preflight."""

from __future__ import annotations

from dataclasses import dataclass

from rldsl.plan import ExecutionPlan, PipelinePlan

BUILTIN_TINY = "builtin:tiny-lm"
BUILTIN_CONTEXT = 64  # rldsl.models.tiny.TinyLMConfig.max_positions (a test keeps them equal)
# rldsl.models.tiny_gpt2.TINY_GPT2: the builtin model (one 64-wide head) written as a Hugging Face GPT-2,
# which every engine loads; its context is tiny-lm's
TINY_GPT2 = "builtin:tiny-gpt2"
# rldsl.models.base.BUILTIN_AGENT: tiny-lm spelling tool calls, with the context of a call, its result and an
# answer (rldsl.models.AGENT_SHAPE; a test keeps them equal)
BUILTIN_AGENT = "builtin:tiny-agent"
BUILTIN_CONTEXTS = {BUILTIN_TINY: BUILTIN_CONTEXT, TINY_GPT2: BUILTIN_CONTEXT, BUILTIN_AGENT: 128}
# the longest prompt of each builtin task in builtin:tiny-lm tokens: one per character, and BOS (a test checks)
BUILTIN_PROMPT_TOKENS = {"builtin:arith": 7, "builtin:reverse": 15}
UNKNOWN_PROMPT_TOKENS = 1  # a prompt of a file whose length `check` cannot know: at least its BOS
# engines that load a local Hugging Face checkpoint (engines/factory.py)
CHECKPOINT_ENGINES = ("vllm", "sglang", "megatron")
TEXTLESS_ENGINES = ("sim",)  # generators without a model or tokenizer: they decode no text


@dataclass(frozen=True)
class Refusal:
    """A refusal of the launcher, with the `check` rule that refuses the file for it."""

    code: str
    pipeline: str
    message: str

    def __str__(self) -> str:
        return f"pipeline `{self.pipeline}`: {self.message} ({self.code}: `rldsl explain {self.code}`)"


# ------------------------------------------------------------- predicates


def checkpoint_refusal(engine: str | None, source: str | None) -> str | None:
    """RLP112: vllm, sglang and megatron load a local `hf:` checkpoint."""
    if engine in CHECKPOINT_ENGINES and source is not None and not (source.startswith("hf:") or source == TINY_GPT2):
        return f"engine `{engine}` loads a local Hugging Face checkpoint (`hf:<path>`), not {source!r}"
    return None


def chat_template_refusal(source: str, chat_template: bool) -> str | None:
    """RLP112: only an `hf:` model's tokenizer has a chat template."""
    if chat_template and not source.startswith("hf:"):
        return f"`chat_template = true` needs an `hf:` model with a chat template; {source} has none"
    return None


def top_p_refusal(top_p: float) -> str | None:
    """RLP106: nucleus sampling keeps a share above 0 (every engine refuses 0)."""
    if not 0 < top_p <= 1:
        return f"top_p = {top_p:g} keeps no token: nucleus sampling needs a share above 0 (1: off)"
    return None


def min_tokens_refusal(min_new_tokens: int, max_new_tokens: int) -> str | None:
    """RLP106: a response cannot hold more tokens than its limit (vLLM's SamplingParams refuses it too)."""
    if min_new_tokens > max_new_tokens:
        return (f"min_new_tokens = {min_new_tokens} is more than max_new_tokens = {max_new_tokens}: no response "
                "can be both")
    return None


VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses a hotter one (its _verify_args)


def temperature_refusal(engine: str | None, temperature: float) -> str | None:
    """RLP106: vLLM samples at temperatures in [0, 2] and refuses every request above."""
    if engine == "vllm" and temperature > VLLM_MAX_TEMPERATURE:
        return (f"temperature = {temperature:g}: vLLM samples at temperatures up to {VLLM_MAX_TEMPERATURE:g} "
                "and refuses every request above")
    return None


def clip_refusal(clip: float) -> str | None:
    """RLP312: the ratio is clipped to [1 - clip, 1 + clip]; at 1 the lower bound is 0 (every trainer refuses)."""
    if not 0 <= clip < 1:
        return f"clip = {clip:g} leaves no lower bound on the ratio (1 - clip = {1 - clip:g}): it must be below 1"
    return None


def textless_refusal(engine: str | None, use: str) -> str | None:
    """RLP116: a sim generator has no model and no tokenizer, so nothing that reads its text can run."""
    if engine in TEXTLESS_ENGINES:
        return f"engine `{engine}` decodes no text (no model, no tokenizer), and {use} reads the model's text"
    return None


LORA_ENGINES = ("torch", "sim")  # engines that train, score and serve LoRA adapters (sim: no model at all)
LORA_SERVING_ENGINES = ("vllm",)  # generators that serve them per request
LORA_TRAINING_ENGINES = ("fsdp",)  # sharded trainers that train them


def lora_refusal(engine: str | None, stage_kind: str, frozen: bool, update: str | None = None,
                 sleep_level: int = 0, source: str | None = None) -> str | None:
    """RLP118: a stage that holds the policy's LoRA adapters on an engine that cannot (a frozen reference
    holds the base alone, on any engine); vLLM serves them to generate, a request keeping its adapter to
    its end, so versions cannot land mid-response."""
    if engine is None or engine in LORA_ENGINES or (stage_kind == "logprob" and frozen):
        return None
    if stage_kind == "train" and engine in LORA_TRAINING_ENGINES:
        return None
    if stage_kind == "generate" and engine in LORA_SERVING_ENGINES:
        if update == "interrupt":
            return (f"engine `{engine}` serves LoRA adapters per request and a request keeps its adapter to its "
                    "end, so `update = interrupt` cannot land a version mid-response")
        if source == TINY_GPT2:
            return (f"engine `{engine}` serves LoRA adapters only on the architectures it implements them for, "
                    f"and {TINY_GPT2} is a GPT-2, which it does not")
        if sleep_level == 2:
            return (f"engine `{engine}` with `sleep = 2` discards the base weights while asleep, and a LoRA push "
                    "carries only the adapters: nothing would restore the base")
        return None
    return (f"the model trains LoRA adapters (`lora_rank`), and engine `{engine}` cannot "
            f"{'train' if stage_kind == 'train' else 'serve'} them yet")


def longest_prompt(sources, max_prompt_tokens: int = 0) -> int:
    """The longest prompt of a dataset's sources, in builtin:tiny-lm tokens, as far as the file tells:
    its `max_prompt_tokens`, a builtin task's longest, or at least the BOS of a file's prompt."""
    lengths = [BUILTIN_PROMPT_TOKENS.get(source, max_prompt_tokens or UNKNOWN_PROMPT_TOKENS) for source in sources]
    if max_prompt_tokens:
        lengths = [min(length, max_prompt_tokens) for length in lengths]
    return max(lengths, default=UNKNOWN_PROMPT_TOKENS)


def response_limit(source: str, engine: str | None, prompt_tokens: int) -> int | None:
    """The longest response the model's context holds after a prompt of ``prompt_tokens`` (None: no
    limit the file shows). The builtin model has 64 positions; a longer sequence fails its forward."""
    context = BUILTIN_CONTEXTS.get(source)
    if context is None or engine in TEXTLESS_ENGINES:
        return None
    return context - prompt_tokens


def context_refusal(source: str, engine: str | None, prompt_tokens: int, max_new_tokens: int) -> str | None:
    """RLP117: responses the model's context cannot hold after the longest prompt."""
    limit = response_limit(source, engine, prompt_tokens)
    if limit is not None and max_new_tokens > limit:
        return (f"{prompt_tokens} prompt tokens + max_new_tokens = {max_new_tokens} pass the {limit + prompt_tokens} "
                f"positions of {source}")
    return None


def shared_logprob_refusal(stage: str, node: int, gpu: int) -> str:
    """RLP513: the GPU lease scheduler gives turns to generator replicas and train steps only
    (``stage``: the stage as the message names it, quoted)."""
    return (f"logprob stage {stage} is on GPU {gpu} of node {node}, which another pipeline shares; the GPU "
            "lease scheduler gives turns to generator replicas and train steps only")


# ------------------------------------------------------------- on a plan


def plan_refusals(plan: ExecutionPlan) -> list[Refusal]:
    """Every refusal of the plan, pipeline by pipeline: the launcher's dry check."""
    out = []
    for pipe in plan.pipelines:
        shared = plan.shared_gpus_of(pipe.name)
        found = (_models(pipe) + _sampling(pipe) + _text(pipe) + _context(pipe) + _shared_logprob(pipe, shared)
                 + _lora(pipe))
        out += [Refusal(code, pipe.name, message) for code, message in found]
    return out


def _models(pipe: PipelinePlan) -> list[tuple[str, str]]:
    sources = {m.name: m.source for m in pipe.models}
    out = [("RLP112", f"stage `{s.name}`: {why}") for s in pipe.stages if s.engine and s.model
           for why in [checkpoint_refusal(s.engine.name, sources.get(s.model))] if why]
    return out + [("RLP112", f"model `{m.name}`: {why}") for m in pipe.models
                  for why in [chat_template_refusal(m.source, m.chat_template)] if why]


def _lora(pipe: PipelinePlan) -> list[tuple[str, str]]:
    adapted = {m.name: m.source for m in pipe.models if m.lora is not None}
    return [("RLP118", f"stage `{s.name}`: {why}") for s in pipe.stages if s.engine and s.model in adapted
            for why in [lora_refusal(s.engine.name, s.kind, bool(s.settings.get("frozen")), s.settings.get("update"),
                                     int(s.engine.args.get("sleep", 0)), adapted[s.model])]
            if why]


def _sampling(pipe: PipelinePlan) -> list[tuple[str, str]]:
    out = [("RLP106", f"stage `{s.name}`: {why}") for s in pipe.stages_of("generate")
           for why in [top_p_refusal(s.settings.get("top_p", 1.0)),
                       temperature_refusal(s.engine.name if s.engine else None, s.settings.get("temperature", 1.0)),
                       min_tokens_refusal(s.settings.get("min_new_tokens", 0), s.settings.get("max_new_tokens", 64))]
           if why]
    return out + [("RLP312", f"stage `{s.name}`: {why}") for s in pipe.stages_of("train")
                  for why in [clip_refusal((s.settings.get("loss") or {}).get("clip", 0.2))] if why]


def _text(pipe: PipelinePlan) -> list[tuple[str, str]]:
    out = []
    for stage in pipe.stages_of("generate"):
        engine = stage.engine.name if stage.engine else None
        uses = ([f"its environment `{stage.settings['environment']}`"] if stage.settings.get("environment") else [])
        uses += ["held-out evaluation on the generators (`eval_on = generators`)"] if \
            pipe.evaluates and pipe.eval_on == "generators" else []
        out += [("RLP116", f"stage `{stage.name}`: {why}") for use in uses for why in [textless_refusal(engine, use)]
                if why]
    return out


def _context(pipe: PipelinePlan) -> list[tuple[str, str]]:
    sources = {m.name: m.source for m in pipe.models}
    prompt = max((longest_prompt(d.options.get("sources") or [d.source], d.options.get("max_prompt_tokens") or 0)
                  for d in pipe.datasets), default=UNKNOWN_PROMPT_TOKENS)
    return [("RLP117", f"stage `{s.name}`: {why}") for s in pipe.stages_of("generate")
            if not s.settings.get("environment")  # an episode's context is RLP601's
            for why in [context_refusal(sources.get(s.model, ""), s.engine.name if s.engine else None, prompt,
                                        s.settings.get("max_new_tokens", 0))] if why]


def _shared_logprob(pipe: PipelinePlan, shared: frozenset[tuple[int, int]]) -> list[tuple[str, str]]:
    out = []
    for stage in pipe.stages_of("logprob"):
        overlap = sorted(where for rank in stage.ranks for where in rank.all_gpus() if where in shared)
        if overlap:
            out.append(("RLP513", shared_logprob_refusal(f"`{stage.name}`", *overlap[0])))
    return out
