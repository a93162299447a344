"""Defaults that differ on real GPUs, written into the plan by the lowering.

A program is a GPU program when its file says it runs on real GPUs: the
cluster declares its `gpu` type or its `gpu_memory`, or a stage runs an
engine that needs a GPU (vLLM, SGLang, megatron). Everything else (the
builtin CPU pipelines on Ray's logical GPUs, the torch and sim engines
without a declared GPU) keeps the language's plain defaults, so those
runs behave as they always did. What a GPU program gets when its file
leaves the key out (docs/language.md says why each value):

- `run { checkpoint_every = 10  keep_checkpoints = 3 }`: a preemption loses
  at most 10 steps, and the disk holds three checkpoints, not one per 10
  steps (a written `checkpoint_every` keeps `keep_checkpoints` at its
  default: nothing the file already saved is deleted);
- `dataset { eval_on = generators }`: a large model decodes its held-out
  prompts on the accelerators, not on a CPU copy that can take longer than
  the run; only where every generate stage's engine decodes text;
- `run { eval_timeout = 10min }`: a replica evaluating generates nothing,
  so one evaluation may pause it at most this long.
"""

from __future__ import annotations

from rldsl.compiler.decls import Decl, Program
from rldsl.compiler.schema import ENGINES

CHECKPOINT_EVERY = 10
KEEP_CHECKPOINTS = 3
EVAL_TIMEOUT_S = 600.0
EVAL_ON = "generators"
DECODING_ENGINES = ("torch", "vllm", "sglang")  # engines that decode text for generator evaluation


def is_gpu_program(program: Program) -> bool:
    cluster = program.cluster
    declared = any(cluster.valid(key) and cluster.get(key) for key in ("gpu", "gpu_memory"))
    return declared or any(_gpu_only(stage) for pipe in program.pipelines for stage in pipe.stages.values())


def _gpu_only(stage: Decl) -> bool:
    engine = stage.get("engine") if stage.valid("engine") else None
    return engine is not None and ENGINES[engine.name].gpu_only


def run_defaults(program: Program, run: Decl) -> dict:
    """The `run` keys a GPU program leaves out, with their GPU values (none for a CPU program)."""
    if not is_gpu_program(program):
        return {}
    out = {"eval_timeout": EVAL_TIMEOUT_S} if not run.explicit("eval_timeout") else {}
    if not run.explicit("checkpoint_every"):
        out["checkpoint_every"] = CHECKPOINT_EVERY
        if not run.explicit("keep_checkpoints"):
            out["keep_checkpoints"] = KEEP_CHECKPOINTS
    return out


def eval_on_default(program: Program, dataset: Decl, generators: list[Decl]) -> str | None:
    """`generators` for a GPU program's dataset that leaves `eval_on` out, when every generate stage's
    engine decodes text; None to keep what the dataset says."""
    if dataset.explicit("eval_on") or not is_gpu_program(program):
        return None
    engines = [g.get("engine") for g in generators if g.valid("engine")]
    if len(engines) != len(generators) or not all(e is not None and e.name in DECODING_ENGINES for e in engines):
        return None
    return EVAL_ON
