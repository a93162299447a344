"""Per-GPU memory estimates from parameter counts and placement.

Deliberately coarse (no activations, no fragmentation): the point is to
catch a 7B trainer on a 24 GiB GPU before launch, not to predict the peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rldsl.compiler.decls import Decl, Program
from rldsl.compiler.diagnostics import ERROR, Diagnostic
from rldsl.compiler.placement import Placement, StagePlacement
from rldsl.compiler.schema import can_sleep
from rldsl.compiler.units import format_bytes

# Builtin models' parameter counts (kept in sync by a test against the model).
BUILTIN_PARAMS = {"tiny-lm": 107_712}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class GpuMemory:
    gpu: int
    used: float  # bytes
    capacity: float | None
    by_stage: tuple[tuple[str, float], ...]  # (pipeline/stage, bytes)
    shared_by_sleep: bool  # residents take turns, so the max counts, not the sum


def model_params(model: Decl, base_dir: Path) -> int | None:
    if model.get("params"):
        return int(model["params"])
    source: str = model["source"]
    if source.startswith("builtin:"):
        return BUILTIN_PARAMS.get(source.removeprefix("builtin:"))
    path = Path(source.removeprefix("hf:"))
    config = (path if path.is_absolute() else base_dir / path) / "config.json"
    import json

    try:
        return _params_from_hf_config(json.loads(config.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _params_from_hf_config(cfg: dict) -> int:
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    inter = cfg.get("intermediate_size", 4 * hidden)
    heads = cfg.get("num_attention_heads", 1)
    kv = cfg.get("num_key_value_heads", heads)
    attn = hidden * hidden * 2 + 2 * hidden * (hidden * kv // heads)
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return embeddings + layers * (attn + 3 * hidden * inter)


def stage_bytes_per_gpu(stage: Decl, model: Decl, sp: StagePlacement, params: int,
                        gpu_capacity: float | None) -> float:
    engine = stage["engine"]
    dtype = model.get("dtype") or engine.args.get("dtype", "fp32")  # the model's dtype wins over the engine's
    shard = max(1, sp.tp * sp.pp)
    weights = params * _DTYPE_BYTES[dtype] / shard
    if stage.stage_kind == "train" and engine.name == "fsdp":
        return fsdp_trainer_bytes(params, engine.args.get("shard") or sp.dp, _DTYPE_BYTES[dtype])
    if stage.stage_kind == "train":
        grads = params * 4 / shard  # fp32 main grads
        optimizer = params * (12 if dtype != "fp32" else 8) / shard  # (master +) AdamW m and v
        if engine.args.get("distributed_optimizer"):
            optimizer /= max(1, sp.dp)
        return weights + grads + optimizer
    if engine.name in ("vllm", "sglang") and gpu_capacity:  # both reserve a share of each GPU up front
        return max(weights, engine.args["gpu_memory"] * gpu_capacity)
    return weights


def fsdp_trainer_bytes(params: int, shard_group: int, dtype_bytes: int) -> float:
    """An fsdp trainer rank: fp32 parameter shards (the master copy, whatever
    the compute dtype) and AdamW m and v, divided by the ranks a copy is
    sharded over; plus, during a step, the parameters gathered in the
    compute dtype and one full fp32 gradient (a mini-batch's microbatches
    run without collectives, so both stay whole until it ends)."""
    return params * (4 + 8) / max(1, shard_group) + params * (dtype_bytes + 4)


def estimate(program: Program, placement: Placement, base_dir: Path) -> list[GpuMemory]:
    capacity = program.cluster.get("gpu_memory")
    per_stage: dict[tuple[str, str], float] = {}
    for pipe in program.pipelines:
        for sp in (s for s in placement.stages.values() if s.pipeline == pipe.name and s.gpus):
            stage = pipe.stages[sp.stage]
            model = _model(pipe, stage)
            params = model_params(model, base_dir) if model and stage["engine"].name != "sim" else None
            if params is not None:  # sim engines hold no model
                per_stage[(sp.pipeline, sp.stage)] = stage_bytes_per_gpu(stage, model, sp, params, capacity)
    out = []
    for gpu, residents in sorted(placement.residents().items()):
        sizes = [(f"{sp.pipeline}/{sp.stage}", per_stage[(sp.pipeline, sp.stage)]) for sp in residents
                 if (sp.pipeline, sp.stage) in per_stage]
        sleepers = all(can_sleep(_decl(program, sp)["engine"]) for sp in residents)
        used = max((b for _, b in sizes), default=0.0) if sleepers else sum(b for _, b in sizes)
        out.append(GpuMemory(gpu, used, capacity, tuple(sizes), sleepers and len(residents) > 1))
    return out


def _model(pipe, stage: Decl) -> Decl | None:
    """The stage's model, when it and every setting the estimate reads resolved."""
    ref = stage.get("model") if stage.valid("model") else None
    model = pipe.models.get(ref.name) if ref else None
    return model if model is not None and model.valid("source", "params", "dtype") else None


def _decl(program: Program, sp: StagePlacement) -> Decl:
    return program.pipeline(sp.pipeline).stages[sp.stage]


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
        parts = ", ".join(f"{name if program.multi else name.split('/')[1]} {format_bytes(b)}"
                          for name, b in mem.by_stage)
        how = "" if len(mem.by_stage) == 1 else "the largest of " if mem.shared_by_sleep else "the sum of "
        out.append(Diagnostic(
            "RLP506", ERROR, f"GPU {mem.gpu} needs about {format_bytes(mem.used)}, more than its "
            f"{format_bytes(capacity)}", decl.name_span,
            notes=(f"estimate: {how}{parts}",),
            help=_memory_help(decl)))
    return out


def _memory_help(stage: Decl) -> str:
    """What shrinks the biggest stage: only megatron has a distributed
    optimizer; a torch trainer's state shards by switching to fsdp."""
    engine = stage["engine"].name
    if engine == "torch" and stage.stage_kind == "train":
        return "shard it with `engine = fsdp` over more GPUs, offload, or use a larger GPU"
    if engine == "megatron":
        return "shard it wider (more GPUs, tp/pp), enable the distributed optimizer or offload, or use a larger GPU"
    return "shard it wider (more GPUs, tp/pp), offload, or use a larger GPU"
