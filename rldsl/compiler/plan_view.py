"""`rldsl plan` and `rldsl graph` output: the GPU map, groups, memory, the
dataflow generations, the staleness vocabulary and a one-line summary."""

from __future__ import annotations

from rldsl.compiler.driver import CompileResult
from rldsl.compiler.equivalents import batch_equivalents, staleness_equivalents
from rldsl.compiler.units import format_bytes, format_duration
from rldsl.layout import leaves_gpus_to_workers
from rldsl.plan import LEASE_QUANTUM_S, ExecutionPlan, PipelinePlan, ahead_groups



def actor_count(plan: ExecutionPlan) -> int:
    # + one controller each, + an evaluator for each pipeline that evaluates
    ranks = sum(len(s.own_ranks) for p in plan.pipelines for s in p.stages)
    return ranks + sum(1 + p.has_evaluator for p in plan.pipelines)


def summary_line(plan: ExecutionPlan) -> str:
    used = {where for p in plan.pipelines for s in p.stages for r in s.own_ranks for where in r.all_gpus()}
    total = plan.cluster.nodes * plan.cluster.gpus_per_node
    nodes = plan.cluster.nodes
    pipes = f"{len(plan.pipelines)} pipelines, " if len(plan.pipelines) > 1 else ""
    return (f"plan: {pipes}{actor_count(plan)} actors on {nodes} node{'s' * (nodes != 1)}, "
            f"{len(used)}/{total} GPUs")


def render_plan(result: CompileResult) -> str:
    plan = result.plan
    out = [f"cluster: {plan.cluster.nodes} node(s) x {plan.cluster.gpus_per_node} GPUs"
           + (f" ({plan.cluster.gpu_type})" if plan.cluster.gpu_type else "")
           + (f", {format_bytes(plan.cluster.gpu_memory_bytes)} each" if plan.cluster.gpu_memory_bytes else ""), ""]
    out += _gpu_map(plan, result)
    out += _stage_memory(result, len(plan.pipelines) > 1)
    out += _sharing(plan)
    for pipe in plan.pipelines:
        out += ["", f"pipeline {pipe.name}"]
        out += _indent(_stages(pipe))
        out += _indent(_dataflow(pipe))
        out += _indent(_staleness(pipe))
    if plan.overrides:
        out += ["", "overrides (--set):"] + [f"  {o}" for o in plan.overrides]
    if plan.warnings:
        out += ["", "warnings:"] + [f"  {w}" for w in plan.warnings]
    out += ["", summary_line(plan)]
    return "\n".join(out) + "\n"


def _indent(lines: list[str]) -> list[str]:
    return [f"  {line}" if line else line for line in lines]


def _gpu_map(plan: ExecutionPlan, result: CompileResult) -> list[str]:
    memory = {m.gpu: m for m in result.memory}
    many = len(plan.pipelines) > 1
    out = ["GPU map:"]
    for node in range(plan.cluster.nodes):
        out.append(f"  node {node}")
        for local in range(plan.cluster.gpus_per_node):
            gpu = node * plan.cluster.gpus_per_node + local
            here = [f"{p.name + '/' if many else ''}{s.name}[{r.index}]{_coords(s, r)}{_serving(plan, p, s)}"
                    for p in plan.pipelines for s in p.stages for r in s.own_ranks if (node, local) in r.all_gpus()]
            mem = memory.get(gpu)
            mem_text = ""
            if mem and mem.by_stage:
                cap = f" / {format_bytes(mem.capacity)}" if mem.capacity else ""
                mem_text = f"   ~{format_bytes(mem.used)}{cap}"
            out.append(f"    gpu {local}: {', '.join(here) or '(idle)'}{mem_text}")
    cpu = [f"{p.name + '/' if many else ''}{s.name}{_index_ranges([r.index for r in s.ranks if not r.gpus])}"
           for p in plan.pipelines for s in p.stages if any(not r.gpus for r in s.ranks)]
    evaluators = [f"{p.name + '/' if many else ''}evaluator" for p in plan.pipelines if p.has_evaluator]
    out.append(f"  cpu: {', '.join(cpu + evaluators + ['controller' + ('s' if many else '')])}")
    return out


def _serving(plan: ExecutionPlan, pipe: PipelinePlan, stage) -> str:
    """` (serves b, c)` after a generator that other pipelines are `served_by`."""
    tenants = [p.name for p in plan.pipelines for s in p.stages if s.served_by == f"{pipe.name}/{stage.name}"]
    return f" (serves {', '.join(tenants)})" if tenants else ""


def _stage_memory(result: CompileResult, many: bool) -> list[str]:
    """Each stage's peak on one of its GPUs, the phase that sets it and what
    holds the bytes (rldsl.compiler.memory_model)."""
    seen: dict[str, object] = {}
    for mem in result.memory:
        for (name, _), detail in zip(mem.by_stage, mem.details):
            seen.setdefault(name if many else name.split("/")[1], detail)
    if not seen:
        return []
    width = max(len(name) for name in seen)
    return ["", "memory per GPU (peak phase: parts):"] + [
        f"  {name:<{width}}  {d.phase} {format_bytes(d.total)}: "
        + ", ".join(f"{what} {format_bytes(b)}" for what, b in d.parts)
        + (", at any time beside the others" if d.concurrent else "" if d.sleeps else ", kept while another stage runs")
        for name, d in seen.items()]


def _sharing(plan: ExecutionPlan) -> list[str]:
    """Which GPUs each pipeline takes turns on, and how turns are given."""
    if not plan.gpus_shared_across_pipelines():
        return []
    out = ["", "GPU sharing (one lease scheduler for the cluster):"]
    for pipe in plan.pipelines:
        shared = sorted(plan.shared_gpus_of(pipe.name))
        if shared:
            gpus = ", ".join(f"{node}:{gpu}" for node, gpu in shared)
            out.append(f"  {pipe.name}: takes turns on GPUs {gpus} (node:gpu); weight {pipe.sharing.weight:g}, "
                       f"priority {pipe.sharing.priority}")
    out += ["  policy: a train step first, then higher priority, then fewest GPU-seconds per weight; a generation "
            "replica gives its GPU back when idle, to a train step, or to a pipeline behind on its share after "
            f"{LEASE_QUANTUM_S:g}s"]
    return out


def _index_ranges(indices: list[int]) -> str:
    """[0-31] rather than thirty-two entries."""
    return f"[{indices[0]}]" if len(indices) == 1 else f"[{indices[0]}-{indices[-1]}]"


def _coords(stage, rank) -> str:
    if stage.tp * stage.pp == 1:
        return ""
    if _one_actor_per_replica(stage):
        return f" tp{stage.tp}" + (f" pp{stage.pp}" if stage.pp > 1 else "")
    return f" tp{rank.tp_rank} pp{rank.pp_rank} dp{rank.dp_rank}"


def _stages(pipe: PipelinePlan) -> list[str]:
    out = [f"model {m.name}: LoRA adapters of rank {m.lora.rank} (scale {m.lora.scale:g}) on "
           f"{', '.join(m.lora.targets)}: only they train, are pushed and are checkpointed; a frozen reference "
           "is the base, the policy with its adapters off" for m in pipe.models if m.lora is not None]
    out.append("stages:")
    for s in pipe.stages:
        if s.kind == "sync":
            bucket = format_bytes(s.settings["bucket"])
            out.append(f"  {s.name:<12} sync      {s.settings['from']} -> {', '.join(s.settings['to'])} "
                       f"in {bucket} buckets")
            continue
        engine = s.engine.name if s.engine else "python"
        shape = f"tp={s.tp} pp={s.pp} dp={s.dp}" if s.ranks and s.ranks[0].gpus else f"{len(s.ranks)} cpu worker(s)"
        colo = f"  shares GPUs with {', '.join(s.colocated_with)}" if s.colocated_with else ""
        if s.served_by:
            shape, colo = f"served by {s.served_by}", " with this pipeline's adapters, per request"
        if s.on_trainer:
            shape, colo = f"on {s.on_trainer}'s ranks", ": its policy with the LoRA adapters off, no copy of its own"
        out.append(f"  {s.name:<12} {s.kind:<9} {engine:<8} {shape}{colo}")
        out += [f"  {'':<12} {line}" for line in _groups(s)]
    b = pipe.batch
    steps = (f"{b.minibatches} optimizer steps of {b.global_batch}" if b.minibatches > 1
             else "one optimizer step") + (f", {b.ppo_epochs} epochs" if b.ppo_epochs > 1 else "")
    tokens = pipe.stage(b.train_stage).settings.get("micro_batch_tokens", 0)
    forward = f"forwards of <= {tokens} tokens" if tokens else f"micro_batch {b.micro_batch}"
    out.append(f"batch: {b.prompts_per_step} prompts x {b.samples_per_prompt} samples = {b.rollout_batch} per step "
               f"({steps}), {forward}; buffer {b.buffer_capacity} groups, {b.max_inflight} in flight")
    out += [f"  = {system}: {text}" for system, text in batch_equivalents(pipe)]
    return out


def _one_actor_per_replica(stage) -> bool:
    """Engines such as vLLM drive a whole replica (its tensor-parallel group) from one actor."""
    from rldsl.compiler.schema import ENGINES

    return bool(stage.engine) and stage.kind in ENGINES[stage.engine.name].replica_actor_kinds


def _groups(stage) -> list[str]:
    """TP / DP / PP groups as node:gpu lists, for stages that have them."""
    gpu_ranks = [r for r in stage.ranks if r.gpus]
    if not gpu_ranks or stage.tp * stage.pp * stage.dp == 1:
        return []
    where = lambda r: ",".join(f"{n}:{g}" for n, g in r.all_gpus())  # noqa: E731
    if _one_actor_per_replica(stage):
        shape = f"tp {stage.tp}" + (f" x pp {stage.pp}" if stage.pp > 1 else "")
        share = gpu_ranks[0].gpu_fraction
        workers = f"; its engine's Ray workers take {share:.2g} of each GPU" \
            if leaves_gpus_to_workers(stage.engine.name, len(gpu_ranks[0].gpus), share) else ""  # rldsl.layout
        return [f"replicas ({shape} each{workers}): " + " ".join(f"[{where(r)}]" for r in gpu_ranks)]
    lines = []
    args = stage.engine.args if stage.engine else {}
    ep, etp = args.get("ep", 1), args.get("etp") or stage.tp
    # megatron's expert grid in a pipeline stage: etp fastest, then ep, over the stage's ranks in order
    place = lambda r: r.tp_rank + stage.tp * r.dp_rank  # noqa: E731
    for name, size, key in (("tp", stage.tp, lambda r: (r.dp_rank, r.pp_rank)),
                            ("dp", stage.dp, lambda r: (r.tp_rank, r.pp_rank)),
                            ("pp", stage.pp, lambda r: (r.tp_rank, r.dp_rank)),
                            (f"ep (each 1/{ep} of the experts)", ep,
                             lambda r: (r.pp_rank, place(r) % etp, place(r) // (etp * ep))),
                            (f"etp (each expert split {etp} ways)", etp if etp != stage.tp else 1,
                             lambda r: (r.pp_rank, place(r) // etp))):
        if size > 1:
            groups: dict = {}
            for r in gpu_ranks:
                groups.setdefault(key(r), []).append(where(r))
            lines.append(f"{name} groups: " + " ".join(f"[{' '.join(g)}]" for g in groups.values()))
    return lines


def _dataflow(pipe: PipelinePlan) -> list[str]:
    out = ["dataflow:"]
    for i, gen in enumerate(pipe.generations):
        out.append(f"  {i}: {', '.join(gen)}")
    for e in pipe.edges:
        if e.kind == "weights":
            out.append(f"  weights: {e.src} -> {e.dst} (via {e.via})")
    return out


def _staleness(pipe: PipelinePlan) -> list[str]:
    st = pipe.staleness
    lag = st.max_lag
    meaning = ("on-policy: every sample is trained by the weights that generated it" if lag == 0 else
               f"a sample is trained at most {lag} version{'s' * (lag != 1)} (rollout batch{'es' * (lag != 1)}) "
               "after the weights that generated it")
    ahead = "" if st.max_ahead is None else (
        f"; max_ahead = {st.max_ahead:g} (at most {ahead_groups(lag, st.max_ahead, pipe.batch.prompts_per_step)} "
        "groups generated before a version train at or after it)")
    out = [f"staleness: max_lag = {lag} ({meaning}){ahead}; order {st.order}; too-stale samples: {st.too_stale}"]
    out += [f"  = {system}: {text}" for system, text in staleness_equivalents(pipe)]
    out.append(f"run: {_run_length(pipe)}, seed {pipe.run.seed}, watchdog {format_duration(pipe.run.watchdog_s)}, "
               f"restarts {pipe.run.restarts}, {_checkpoints(pipe.run)}")
    out.append(f"evaluation: {_evaluation(pipe)}")
    budget = pipe.datasets[0].options.get("max_prompt_tokens", 0) if pipe.datasets else 0
    if budget and pipe.datasets[0].options.get("long_prompts", "drop") == "truncate":
        out.append(f"prompts: those over {budget} tokens are cut to {budget} when the dataset is read, their "
                   "samples generated and scored but left out of the loss (the count is logged)")
    elif budget:
        out.append(f"prompts: those over {budget} tokens are dropped when the dataset is read (the count is logged)")
    return out


def _evaluation(pipe: PipelinePlan) -> str:
    """Where the held-out prompts come from (said, so nobody takes training accuracy for held-out)."""
    if not pipe.datasets:
        return "none"
    dataset = pipe.datasets[0]
    size, source = dataset.options.get("eval_size", 0), dataset.options.get("eval_source")
    if not size:
        return "off (eval_size = 0)"
    if not pipe.run.asks_evaluation:
        return "none asked for (eval_every = 0, eval_at_start = false, eval_at_end = false)"
    if not pipe.evaluates:
        return "none (the trainer's engine holds no weights)"
    where = " (decoded on the generators)" if pipe.eval_on == "generators" else ""
    if pipe.run.eval_timeout_s:
        where += f", each within {format_duration(pipe.run.eval_timeout_s)}"
    if source:
        return f"{size} prompts of {source}{where}{_eval_times(pipe.run)}"
    if dataset.source.startswith("jsonl:") and "{split}" not in dataset.source:
        return (f"{size} prompts held out of {dataset.source}: the rows whose prompt hashes into the eval share "
                f"(about 5%), which training never reads{where}{_eval_times(pipe.run)}")
    return f"{size} prompts of the held-out split of {dataset.source}{where}{_eval_times(pipe.run)}"


def _checkpoints(run) -> str:
    """When checkpoints are written: on the grid, and always at a stop and at the end of the run."""
    if not run.checkpoint_every:
        return "checkpoints at a stop and at the end"
    kept = f", the newest {run.keep_checkpoints} kept" if run.keep_checkpoints else ""
    return f"checkpoints every {run.checkpoint_every} steps and at the end{kept}"


def _eval_times(run) -> str:
    """When, said only where the start or the end is left out (by default both are evaluated)."""
    if run.eval_at_start and run.eval_at_end:
        return ""
    asked = [f"every {run.eval_every} steps"] if run.eval_every else []
    asked += ["at the start"] if run.eval_at_start else ["at the end"] if run.eval_at_end else []
    skipped = [moment for moment, on in (("the start", run.eval_at_start), ("the end", run.eval_at_end)) if not on]
    return f"; {' and '.join(asked)}, not at {' or '.join(skipped)}"


def _run_length(pipe: PipelinePlan) -> str:
    run, optimizer = pipe.run, pipe.batch.optimizer_steps_per_step
    if run.epochs:
        epochs = f"{run.epochs} epoch{'s' * (run.epochs != 1)}"
        if run.max_steps:
            return (f"{run.max_steps} steps or {epochs}, whichever is reached first (an epoch's steps are counted "
                    "when the dataset is read; `rldsl run` says which bound ends the run)")
        return f"{epochs} (steps counted when the dataset is read)"
    text = f"{run.steps} steps" + _samples_bound(run, pipe.batch.rollout_batch)
    return text + (f", {run.steps * optimizer} optimizer steps" if optimizer > 1 else "")


def _samples_bound(run, rollout_batch: int) -> str:
    """Which of `samples` and a `steps` written beside it ends the run."""
    if not run.samples:
        return ""
    if not run.max_steps:
        return f" ({run.samples} samples)"
    of_samples = -(-run.samples // rollout_batch)
    if of_samples == run.max_steps:
        return f" (samples = {run.samples} and steps = {run.max_steps} end the run together)"
    if of_samples < run.max_steps:
        return f" (samples = {run.samples} ends the run before steps = {run.max_steps})"
    return f" (steps = {run.max_steps} ends the run before samples = {run.samples}, which would take {of_samples})"


def _graph_parts(plan: ExecutionPlan):
    """Nodes (id, label, shape) and edges (src, dst, label, is_data) of every
    pipeline, ids prefixed by the pipeline when there are several."""
    nodes, edges = [], []
    for pipe in plan.pipelines:
        prefix = f"{pipe.name}_" if len(plan.pipelines) > 1 else ""
        nodes += [(prefix + d.name, d.name, "dataset") for d in pipe.datasets]
        nodes += [(prefix + s.name, f"{s.name} ({s.kind})", "stage") for s in pipe.stages if s.kind != "sync"]
        edges += [(prefix + e.src, prefix + e.dst,
                   ", ".join(e.fields) if e.kind == "data" else f"weights ({e.via})", e.kind == "data")
                  for e in pipe.edges]
    return nodes, edges


def render_graph(plan: ExecutionPlan, fmt: str) -> str:
    nodes, edges = _graph_parts(plan)
    if fmt == "mermaid":
        lines = ["flowchart LR"]
        lines += [f"  {i}[({label})]" if shape == "dataset" else f'  {i}["{label}"]' for i, label, shape in nodes]
        lines += [f"  {a} {'-->' if data else '-.->'}|{label}| {b}" for a, b, label, data in edges]
    else:
        lines = ["digraph rldsl {", "  rankdir=LR;"]
        lines += [f'  "{i}" [shape={"cylinder" if shape == "dataset" else "box"}, label="{label}"];'
                  for i, label, shape in nodes]
        lines += [f'  "{a}" -> "{b}" [style={"solid" if data else "dashed"}, label="{label}"];'
                  for a, b, label, data in edges]
        lines.append("}")
    return "\n".join(lines) + "\n"
