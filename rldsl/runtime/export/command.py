"""`rldsl export RUN_DIR --out DIR`: a run's trained policy as a Hugging Face directory.

Which checkpoint: the newest complete one (``trainer.json`` and
``progress.json`` both written, ``ray_lowering/checkpoint.py``), or the
version asked for. Which model and engine: the run's own ``plan.json``,
the train stage's model source and engine (``trainer.json`` records the
engine that wrote the files, and wins). The directory is written next to
``--out`` under a temporary name and moved into place when complete, so an
interrupted export leaves no half-written model behind.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from rldsl.plan import ExecutionPlan, ModelPlan, PipelinePlan, PlanFormatError
from rldsl.models import TINY_GPT2
from rldsl.runtime.export.adapters import ADAPTER_DIR, AdaptedPolicy
from rldsl.runtime.export.checkpoints import ExportError, module_state, read_checkpoint
from rldsl.runtime.export.writer import DEFAULT_SHARD_SIZE, save_model, size_on_disk
from rldsl.runtime.ray_lowering.checkpoint import TRAINER_DIR, TRAINER_MARKER, checkpoint_dir, complete_checkpoints

EXIT_OK, EXIT_USAGE = 0, 2
OPTIONAL_LIBRARIES = ("transformers", "tokenizers", "safetensors")
RUN_DIR_HELP = "pass the directory a `rldsl run` wrote (its last line names it), e.g. runs/grpo_async-..."


@dataclass
class Exported:
    out: Path
    version: int
    engine: str
    source: str  # the plan's model source
    architecture: str  # the transformers class, e.g. GPT2LMHeadModel; ADAPTER_ONLY for a PEFT adapter alone
    bytes: int
    base: str | None = None  # an adapter's base directory (PeftModel.from_pretrained(base, out))


ADAPTER_ONLY = "a PEFT LoRA adapter"


def export_command(run_dir: Path, out: Path, version: int | None = None, force: bool = False,
                   pipeline: str | None = None, merge: bool = False) -> int:
    try:
        done = export_run(run_dir, out, version, force, pipeline, merge=merge)
    except ImportError as err:
        if err.name not in OPTIONAL_LIBRARIES:
            raise  # our own bug, not a missing install
        return _usage_error(ExportError(f"exporting needs `{err.name}`, which is not installed",
                                        "pip install -e '.[run,hf]'"))
    except ExportError as err:
        return _usage_error(err)
    print(f"exported v{done.version:06d} of {done.source} ({done.engine} trainer) as {done.architecture}, "
          f"{done.bytes / 1e6:.1f} MB of weights")
    if done.architecture == ADAPTER_ONLY:
        print(f"wrote {done.out}  (load it with peft.PeftModel.from_pretrained(base, \"{done.out}\") on "
              f"{done.base}; `--merge` writes the merged model too)")
    else:
        print(f"wrote {done.out}  (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    return EXIT_OK


def _usage_error(err: ExportError) -> int:
    print(f"error: {err}", file=sys.stderr)
    if err.help_text:
        print(f"  = help: {err.help_text}", file=sys.stderr)
    return EXIT_USAGE


def export_run(run_dir: Path, out: Path, version: int | None = None, force: bool = False,
               pipeline: str | None = None, max_shard_size: str = DEFAULT_SHARD_SIZE, merge: bool = False) -> Exported:
    """A LoRA run on a Hugging Face base exports its PEFT adapter alone unless ``merge``; with it, and for
    the builtin model (no base PEFT could load it on), the merged model (and the adapter in OUT/adapter)."""
    run_dir, out = Path(run_dir), Path(out).resolve()  # `--out .` has a name and a parent too
    plan = _read_plan(run_dir)
    pipe, root = _pipeline(plan, run_dir, pipeline)
    checkpoint = _checkpoint(root, version)
    trained = _trained_model(pipe)
    source, planned_engine = trained.source, pipe.stage(pipe.batch.train_stage).engine.name
    if source == TINY_GPT2:  # trained as the Hugging Face GPT-2 of its (cached) warm start: exported as that model
        from rldsl.runtime.engines.factory import builtin_model_dir

        model_plan = next(m for m in pipe.models if m.source == TINY_GPT2)
        source = f"hf:{builtin_model_dir(model_plan, pipe, pipe.run.seed)}"
    engine = _marker(checkpoint).get("engine", planned_engine)  # the engine that wrote the files
    _check_out(out, run_dir, force)
    adapted = None
    if trained.lora is not None:  # the checkpoint holds the adapters: the base comes from where the run had it
        adapted = AdaptedPolicy(trained, pipe, module_state(engine, checkpoint / TRAINER_DIR))
        if source.startswith("hf:") and not merge:
            return _written(out, lambda staging: adapted.write_peft(staging, source[len("hf:"):]),
                            Exported(out, int(checkpoint.name[1:]), engine, trained.source, ADAPTER_ONLY, 0,
                                     source[len("hf:"):]))
    model = read_checkpoint(engine, checkpoint / TRAINER_DIR, source, None if adapted is None else adapted.merged())
    if engine == "fsdp":
        model.state = in_compute_dtype(model.state, pipe.stage(pipe.batch.train_stage).engine.args.get("dtype"))

    def write(staging: Path) -> str:
        if adapted is not None and source.startswith("hf:"):
            adapted.write_peft(staging / ADAPTER_DIR, source[len("hf:"):])
        architecture = save_model(staging, model.config, model.state, max_shard_size)
        model.write_tokenizer(staging)
        return architecture

    try:
        return _written(out, write, Exported(out, int(checkpoint.name[1:]), engine, model.source, "", 0))
    except ValueError as err:  # a tensor without a place in the architecture, or a wrong shape
        raise ExportError(f"the checkpoint does not fit the model ({model.source}): {err}") from err


def _written(out: Path, write, exported: Exported) -> Exported:
    """``write(staging)`` into a directory beside ``out``, moved into place once complete (an interrupted
    export leaves nothing behind); ``exported`` with the architecture ``write`` returned and the bytes."""
    staging = out.parent / f".{out.name}.exporting"
    try:
        shutil.rmtree(staging, ignore_errors=True)  # left by an export that was killed
        staging.mkdir()
        architecture = write(staging)
        if out.exists():
            shutil.rmtree(out)  # only with --force (or empty): _check_out said so
        staging.rename(out)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, OSError):
            raise ExportError(f"cannot write {out}: {err}", "choose another --out") from err
        raise
    return replace(exported, architecture=architecture or exported.architecture, bytes=size_on_disk(out))


def in_compute_dtype(state: dict, dtype: str | None) -> dict:
    """An fsdp checkpoint's fp32 master weights in the compute dtype the trainer's forwards used
    (`bf16`: half the bytes, as its pushes); unchanged for `fp32`."""
    if dtype in (None, "fp32"):
        return state
    from rldsl.runtime.engines.fsdp.sharding import DTYPES

    return {name: t.to(DTYPES[dtype]) if t.is_floating_point() else t for name, t in state.items()}


def _read_plan(run_dir: Path) -> ExecutionPlan:
    if not run_dir.is_dir() or not (run_dir / "plan.json").is_file():
        raise ExportError(f"{run_dir} is not a run directory (it has no plan.json)", RUN_DIR_HELP)
    try:
        return ExecutionPlan.from_json((run_dir / "plan.json").read_text())
    except (OSError, UnicodeDecodeError, PlanFormatError, ValueError, KeyError, TypeError) as err:
        raise ExportError(f"{run_dir / 'plan.json'} cannot be read: {err}", RUN_DIR_HELP) from err


def _pipeline(plan: ExecutionPlan, run_dir: Path, name: str | None) -> tuple[PipelinePlan, Path]:
    """The pipeline to export and its checkpoint root (a run of several
    pipelines keeps each one's under RUN_DIR/<pipeline>)."""
    names = [pipe.name for pipe in plan.pipelines]
    if name is None and len(names) > 1:
        raise ExportError(f"{run_dir} ran {len(names)} pipelines: say which to export",
                          "--pipeline " + " or --pipeline ".join(names))
    if name is not None and name not in names:
        raise ExportError(f"{run_dir} has no pipeline {name!r}", "pipelines: " + ", ".join(names))
    pipe = plan.pipeline(name)
    return pipe, run_dir / pipe.name if len(names) > 1 else run_dir


def _trained_model(pipe: PipelinePlan) -> ModelPlan:
    """The train stage's model (the stage has an engine)."""
    train = next((stage for stage in pipe.stages if stage.name == pipe.batch.train_stage), None)
    model = next((model for model in pipe.models if train and model.name == train.model), None)
    if model is None or train.engine is None:
        raise ExportError(f"pipeline {pipe.name} trains no model, so there is nothing to export")
    return model


def _checkpoint(root: Path, version: int | None) -> Path:
    versions = [int(d.name[1:]) for d in complete_checkpoints(root)]
    if not versions:
        raise ExportError(f"{root} has no complete checkpoint (checkpoints/vNNNNNN/ with trainer.json and "
                          "progress.json)",
                          "a run checkpoints every `run { checkpoint_every }` versions, when it is stopped and "
                          "when it finishes; one that failed before its first checkpoint has none")
    if version is None:
        return checkpoint_dir(root, versions[-1])
    if version not in versions:
        raise ExportError(f"{root} has no complete checkpoint at version {version}",
                          "complete checkpoints: " + ", ".join(str(v) for v in versions))
    return checkpoint_dir(root, version)


def _marker(checkpoint: Path) -> dict:
    try:
        return json.loads((checkpoint / TRAINER_MARKER).read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"{checkpoint / TRAINER_MARKER} cannot be read: {err}",
                          "export another version with --version") from err


def _check_out(out: Path, run_dir: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory", "choose another --out")
    run = run_dir.resolve()
    if out == run or out in run.parents:  # --force would delete the run
        raise ExportError(f"--out {out} is the run directory or holds it", "export to a directory of its own")
    if out.exists() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty", "choose another --out, or add --force to replace it")
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent} does not exist", "create it first, or choose another --out")
