"""Per-GPU memory estimates of a placed program, and RLP506.

Each placed stage's peak on one of its GPUs comes from
rldsl.compiler.memory_model (per engine and phase, from the model's shape
and the stage's microbatch); a GPU counts the largest peak among its
stages that take turns (sleep or offload while another runs) plus every
stage that cannot, and every logprob stage, which scores at any time. A
setting the estimate
needs that did not resolve leaves that stage out (its parameter count) or
its activations out (its token counts): the estimate stays a lower bound
rather than a guess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from rldsl.compiler import memory_model as mm
from rldsl.compiler.decls import Decl, Pipeline, Program
from rldsl.compiler.diagnostics import ERROR, Diagnostic
from rldsl.compiler.placement import Placement, StagePlacement, reference_on_trainer, server_of
from rldsl.compiler.schema import can_sleep, stage_engine_args
from rldsl.compiler.units import format_bytes
from rldsl.plan import lora_default_targets

# Builtin models' parameter counts (kept in sync by a test against the model) and shapes.
BUILTIN_PARAMS = {"tiny-lm": 107_712, "tiny-gpt2": 280_448, "tiny-agent": 112_256}  # the built models' (a test checks)
BUILTIN_SHAPES = {"tiny-lm": mm.ModelShape(hidden=64, layers=2, ffn=256, vocab=55, kv=64, tied=True, context=64),
                  "tiny-gpt2": mm.ModelShape(hidden=128, layers=2, ffn=256, vocab=55, kv=128, tied=True, context=64),
                  "tiny-agent": mm.ModelShape(hidden=64, layers=2, ffn=256, vocab=62, kv=64, tied=True, context=128)}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Prompt tokens assumed in a row when no generator's `max_model_len` bounds
# prompt + response (the language has no prompt length).
PROMPT_TOKENS = 1024
# What reading a config.json written by anyone can raise: the estimate then
# falls back (parameter count unknown, reference shape).
_CONFIG_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError)


@dataclass(frozen=True)
class GpuMemory:
    gpu: int
    used: float  # bytes
    capacity: float | None
    by_stage: tuple[tuple[str, float], ...]  # (pipeline/stage, peak bytes)
    shared_by_sleep: bool  # several residents, some taking turns
    details: tuple[mm.StageMemory, ...] = ()  # per entry of by_stage


def model_params(model: Decl, base_dir: Path) -> int | None:
    if model.get("params"):
        return int(model["params"])
    source: str = model["source"]
    if source.startswith("builtin:"):
        return BUILTIN_PARAMS.get(source.removeprefix("builtin:"))
    try:
        return _params_from_hf_config(_hf_config(model, base_dir))
    except _CONFIG_ERRORS:
        return None


def model_shape(model: Decl, base_dir: Path, params: float) -> mm.ModelShape:
    """The builtin model's own shape, an `hf:` model's config.json, else the
    reference shape nearest in parameter count."""
    name = model["source"].removeprefix("builtin:")
    if name in BUILTIN_SHAPES and params == BUILTIN_PARAMS.get(name):
        return BUILTIN_SHAPES[name]
    return hf_shape(model, base_dir) or mm.nearest_shape(params)


def hf_shape(model: Decl, base_dir: Path) -> mm.ModelShape | None:
    """An `hf:` model's shape from its config.json; None where it cannot be read."""
    try:
        return mm.shape_from_hf_config(_hf_config(model, base_dir))
    except _CONFIG_ERRORS:
        return None


def hf_config(model: Decl, base_dir: Path) -> dict | None:
    """An `hf:` model's config.json (a multimodal one's text model); None where it cannot be read."""
    try:
        config = _hf_config(model, base_dir)
    except _CONFIG_ERRORS:
        return None
    return config.get("text_config", config) if isinstance(config, dict) else None


def _hf_config(model: Decl, base_dir: Path) -> dict:
    source: str = model["source"]
    if not source.startswith("hf:"):
        raise ValueError("not a Hugging Face model")
    path = Path(source.removeprefix("hf:"))
    return json.loads(((path if path.is_absolute() else base_dir / path) / "config.json").read_text())


def _params_from_hf_config(cfg: dict) -> int:
    """Every parameter, each expert of a mixture-of-experts layer included."""
    shape = mm.shape_from_hf_config(cfg)
    return shape.embedding_params + shape.layers * shape.layer_params


def estimate(program: Program, placement: Placement, base_dir: Path) -> list[GpuMemory]:
    capacity = program.cluster.get("gpu_memory")
    per_stage = stage_estimates(program, placement, base_dir)
    out = []
    for gpu, residents in sorted(placement.residents().items()):
        here = [(f"{sp.pipeline}/{sp.stage}", per_stage[(sp.pipeline, sp.stage)]) for sp in residents
                if (sp.pipeline, sp.stage) in per_stage]
        awake_alone = max((m.total - m.asleep for _, m in here), default=0.0)
        used = sum(m.asleep for _, m in here) + awake_alone
        out.append(GpuMemory(gpu, used, capacity, tuple((name, m.total) for name, m in here),
                             len(residents) > 1 and any(m.takes_turns for _, m in here), tuple(m for _, m in here)))
    return out


def stage_estimates(program: Program, placement: Placement, base_dir: Path) -> dict[tuple[str, str], mm.StageMemory]:
    """(pipeline, stage) -> its peak on one of its GPUs, for every placed
    stage whose model and engine resolved (sim engines hold no model)."""
    capacity = program.cluster.get("gpu_memory")
    out = {}
    for pipe in program.pipelines:
        for sp in (s for s in placement.stages.values() if s.pipeline == pipe.name and s.gpus):
            stage = pipe.stages[sp.stage]
            model = _model(pipe, stage)
            if model is None or not stage.valid("engine") or stage["engine"].name == "sim":
                continue
            params = model_params(model, base_dir)
            if params is not None:
                out[(sp.pipeline, sp.stage)] = _stage_memory(pipe, stage, sp, model, params, base_dir, capacity,
                                                             _tenants(program, pipe.name),
                                                             bool(reference_on_trainer(pipe, stage, placement)))
    return out


def _tenants(program: Program, server: str) -> list[tuple[Pipeline, Decl]]:
    """The generate stages of other pipelines `served_by` pipeline ``server``, with their pipelines."""
    return [(p, s) for p in program.pipelines for s in p.stages_of("generate")
            if server_of(s) == server]


def _stage_memory(pipe: Pipeline, stage: Decl, sp: StagePlacement, model: Decl, params: int, base_dir: Path,
                  capacity: float | None, tenants: list[tuple[Pipeline, Decl]] = (),
                  on_trainer: bool = False) -> mm.StageMemory:
    engine, kind = stage["engine"], stage.stage_kind
    c = _DTYPE_BYTES[model.get("dtype") or engine.args.get("dtype", "fp32")]  # the model's dtype wins
    shape = model_shape(model, base_dir, params)
    sleeps = can_sleep(engine) and kind != "reward"  # a reward model stays resident: nothing puts it to sleep
    if kind == "logprob":  # it scores whenever a group arrives: counted in every phase of the others
        held = 0 if on_trainer else params  # its trainer's policy scores it, adapters off: no weights of its own
        return replace(_logprob_memory(pipe, stage, sp, held, shape, c, capacity, sleeps), concurrent=True)
    if engine.name in ("vllm", "sglang"):
        return mm.reserving_generator(params, c, sp.tp * sp.pp, engine.args["gpu_memory"], capacity, sleeps)
    if kind == "generate":  # the base once; each pipeline it serves adds its adapters and its decode batch
        served = [(pipe, stage), *tenants]
        rows = [_decode_rows(s) for _, s in served]
        adapters = sum(_lora_trained(m, shape) or 0 for p, s in served for m in [_model(p, s)] if m is not None)
        return mm.torch_generator(params, shape, c, None if None in rows else sum(rows), _row_tokens(pipe, shape),
                                  sleeps, adapters)
    if kind == "reward":
        return _reward_model(pipe, stage, params, shape, c)
    tokens, bucket = _train_tokens(pipe, stage, shape), _sync_bucket(pipe, stage)
    if engine.name == "fsdp":
        return mm.fsdp_trainer(params, shape, c, engine.args.get("shard") or sp.dp, tokens, bucket, sleeps,
                               _lora_trained(model, shape))
    if engine.name == "megatron":
        return mm.megatron_trainer(params, shape, c, sp.tp, sp.pp, sp.dp,
                                   bool(engine.args.get("distributed_optimizer")), tokens, sleeps,
                                   engine.args.get("ep", 1), engine.args.get("etp"), bucket)
    return mm.torch_trainer(params, shape, c, tokens, bucket, sleeps, _lora_trained(model, shape))


def _decode_rows(stage: Decl) -> int | None:
    """Rows one generator decodes at once for this stage: a group per request in flight."""
    if not stage.valid("samples_per_prompt", "concurrency"):
        return None
    return stage["samples_per_prompt"] * max(1, stage.get("concurrency", 0))


def _lora_trained(model: Decl, shape: mm.ModelShape) -> int | None:
    """A LoRA model's adapter parameters (what trains), None for full-parameter training."""
    if not model.valid("lora_rank", "lora_targets", "source") or not model.get("lora_rank"):
        return None
    targets = model.get("lora_targets") or lora_default_targets(model["source"])
    return mm.lora_params(shape, model["lora_rank"], list(targets))


def _logprob_memory(pipe: Pipeline, stage: Decl, sp: StagePlacement, params: int, shape: mm.ModelShape, c: int,
                    capacity: float | None, sleeps: bool) -> mm.StageMemory:
    """A logprob stage's forward: vLLM and SGLang hold their reserved share;
    the torch and fsdp engines log-softmax their logits a slice at a time."""
    engine = stage["engine"]
    if engine.name in ("vllm", "sglang"):
        return mm.reserving_generator(params, c, sp.tp * sp.pp, engine.args["gpu_memory"], capacity, sleeps)
    tokens, sliced = _logprob_tokens(pipe, stage, shape), engine.name in ("torch", "fsdp")
    shard = stage_engine_args(engine, "logprob").get("shard", 1) if engine.name == "fsdp" else 1
    if shard != 1 and sp.dp > 1:  # a sharded fsdp copy, over all its ranks for 0
        return mm.fsdp_logprob(params, shape, c, shard or sp.dp, tokens, sleeps)
    held = mm.megatron_rank_params(params, shape, sp.tp, sp.pp, sp.dp, engine.args.get("ep", 1),
                                   engine.args.get("etp")) if engine.name == "megatron" else None
    return mm.logprob_stage(params, shape, c, sp.tp * sp.pp, tokens, sleeps, sliced, held)


def _reward_model(pipe: Pipeline, stage: Decl, params: int, shape: mm.ModelShape, c: int) -> mm.StageMemory:
    """A reward model on the torch engine: the weights and one forward of
    `micro_batch` rows (`score`), or the KV cache of a greedy decode of them,
    the judge's answer after the row (`generate`)."""
    rows = stage["micro_batch"] if stage.valid("micro_batch") else None
    row = _row_tokens(pipe, shape)
    if stage.get("judge") == "generate":
        answer = stage["max_new_tokens"] if stage.valid("max_new_tokens") else None
        return mm.torch_generator(params, shape, c, rows, row + answer if row and answer else None, sleeps=False)
    return mm.logprob_stage(params, shape, c, 1, rows * row if rows and row else None, sleeps=False)


def _generators(pipe: Pipeline) -> list[Decl]:
    return [g for g in pipe.stages_of("generate") if g.valid("engine", "max_new_tokens", "samples_per_prompt")]


def _row_tokens(pipe: Pipeline, shape: mm.ModelShape) -> int | None:
    """The longest row a generator of the pipeline writes: its engine's
    `max_model_len` (prompt + response), else `max_new_tokens` plus
    PROMPT_TOKENS; never past the model's context."""
    rows = [g["engine"].args.get("max_model_len") or g["max_new_tokens"] + PROMPT_TOKENS for g in _generators(pipe)]
    if not rows:
        return None
    return min(max(rows), shape.context) if shape.context else max(rows)


def _train_tokens(pipe: Pipeline, train: Decl, shape: mm.ModelShape) -> int | None:
    """Tokens in one forward on one rank: `micro_batch_tokens`, else
    `micro_batch` rows (default one group) of the longest row."""
    if not train.valid("micro_batch", "micro_batch_tokens"):
        return None
    if train.get("micro_batch_tokens"):
        return train["micro_batch_tokens"]
    groups = [g["samples_per_prompt"] for g in _generators(pipe)]
    rows, row = train.get("micro_batch") or max(groups, default=0), _row_tokens(pipe, shape)
    return rows * row if rows and row else None


def _logprob_tokens(pipe: Pipeline, stage: Decl, shape: mm.ModelShape) -> int | None:
    """Tokens in one logprob forward: `micro_batch_tokens`, else `micro_batch` rows of the longest row."""
    if not stage.valid("micro_batch", "micro_batch_tokens"):
        return None
    if stage.get("micro_batch_tokens"):
        return stage["micro_batch_tokens"]
    rows, row = stage["micro_batch"], _row_tokens(pipe, shape)
    return rows * row if rows and row else None


def _sync_bucket(pipe: Pipeline, train: Decl) -> float:
    """The largest bucket a sync from this stage exports in (0: no sync)."""
    syncs = [s for s in pipe.stages_of("sync") if s.valid("from", "bucket") and s["from"].name == train.name]
    return max((s["bucket"] for s in syncs), default=0.0)


def _model(pipe, stage: Decl) -> Decl | None:
    """The stage's model, when it and every setting the estimate reads resolved."""
    model = pipe.model_of(stage)
    return model if model is not None and model.valid("source", "params", "dtype") else None


def check_memory(program: Program, placement: Placement, base_dir: Path) -> list[Diagnostic]:
    """RLP506: estimated bytes per GPU above the declared GPU memory."""
    capacity = program.cluster.get("gpu_memory")
    if not capacity:
        return []
    out, reported = [], set()
    for mem in estimate(program, placement, base_dir):
        if mem.used <= capacity or not mem.by_stage:
            continue
        biggest = max(mem.by_stage, key=lambda s: s[1])[0]
        if biggest in reported:
            continue
        reported.add(biggest)
        pipeline, stage = biggest.split("/")
        decl = program.pipeline(pipeline).stages[stage]
        out.append(Diagnostic(
            "RLP506", ERROR, f"GPU {mem.gpu} needs about {format_bytes(mem.used)}, more than its "
            f"{format_bytes(capacity)}", decl.name_span,
            notes=_memory_notes(program, mem), help=_memory_help(program, mem)))
    return out


def _memory_notes(program: Program, mem: GpuMemory) -> tuple[str, ...]:
    """One line per stage on the GPU (its peak phase, split by what holds
    the bytes), then how the stages add up."""
    notes = []
    for (name, _), detail in zip(mem.by_stage, mem.details):
        parts = " + ".join(f"{what} {format_bytes(b)}" for what, b in detail.parts)
        notes.append(f"{name if program.multi else name.split('/')[1]} ({detail.phase}): {parts}")
    if len(mem.details) > 1:
        sleeping = sum(d.takes_turns for d in mem.details)
        notes.append("they sleep in turn: the GPU counts the largest" if sleeping == len(mem.details) else
                     "none of them takes turns: they add up" if not sleeping else
                     "the GPU counts the largest of those that sleep plus every one that cannot")
        if any(d.concurrent for d in mem.details):
            notes.append("a logprob stage scores while the others run: its forward counts beside each of them")
    return tuple(notes)


def _memory_help(program: Program, mem: GpuMemory) -> str:
    """The levers that move this GPU's estimate, for its largest parts first (a logprob stage's forward,
    which counts beside everything else, is often one): each names the setting and the stage, never a
    setting already on nor one the engine lacks (fsdp has no tp/pp)."""
    parts = sorted(((b, name, what) for (name, _), detail in zip(mem.by_stage, mem.details)
                    for what, b in detail.parts), reverse=True)
    levers: list[str] = []
    for _, name, what in parts:
        pipeline, stage = name.split("/")
        lever = _lever(program.pipeline(pipeline).stages[stage], what, program.label(pipeline, stage))
        if lever and lever not in levers:
            levers.append(lever)
    return "; ".join(levers[:3] + ["or use a larger GPU"])


def _lever(stage: Decl, part: str, label: str) -> str | None:
    """What shrinks one part of a stage's peak, in its engine's terms (None: nothing the file sets)."""
    engine, args = stage["engine"].name, stage["engine"].args
    if part == "activations" and stage.stage_kind in ("train", "logprob"):
        if stage.get("micro_batch_tokens"):
            return f"lower `micro_batch_tokens` of {label} (now {stage['micro_batch_tokens']})"
        rows = stage.get("micro_batch")
        return f"lower `micro_batch` of {label}" + (f" (now {rows} rows per forward)" if rows else "")
    if part in ("kv cache", "activations"):
        return f"fewer groups in flight (`concurrency`) or a shorter `max_new_tokens` on {label}"
    if part == "reserved share":
        return f"a smaller `gpu_memory` share for {label} (now {args['gpu_memory']:.0%})"
    if part == "buckets":
        return f"a smaller sync `bucket` from {label}"
    if part == "optimizer" and engine == "megatron" and not args.get("distributed_optimizer"):
        return f"`distributed_optimizer = true` on {label}"
    return _sharding(stage, engine, label)


def _sharding(stage: Decl, engine: str, label: str) -> str:
    """Splitting a stage's weights, gradients and optimizer state over more GPUs."""
    if engine == "torch" and stage.stage_kind in ("generate", "reward"):
        return f"generate for {label} with `engine = vllm(tp = ...)` over more GPUs (an `hf:` model)"
    if engine == "torch":
        return f"shard {label} with `engine = fsdp`" + (" (`shard = 0`)" if stage.stage_kind == "logprob" else "") \
            + " over more GPUs"
    if engine == "fsdp":
        return f"shard {label} over more GPUs (fsdp shards over its ranks)"
    return f"split {label} over more GPUs (a larger tp" + (" or pp" if engine != "sglang" else "") + ")"
