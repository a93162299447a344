"""Old meanings kept: a file that checked before a rule tightened still
checks, plans and runs with the meaning it had, with a warning whose edit
`rldsl fmt --fix` applies to write that meaning out in the current form.

As for a renamed setting (RLP109, renames.py), the old form is read as the
current one before any rule runs, so every rule and the plan see the
current form and nothing else changes:

- RLP210: a policy (not `frozen`) logprob stage on its trainer's GPUs
  (`colocate` names the trainer, or both are in one placement group) with
  no sync to it. Until RLP205 covered such a stage it was exempt from
  syncs, documented as scoring with the trainer's weights; it is read as
  one more target of the trainer's sync, so the plan has the weight edge
  and the runtime pushes every version to it (rldsl.plan.weight_receivers).
  A trainer without a sync gets none made up: its generators lack one too,
  which RLP205 reports with the edit that adds it.

- RLP521: a generate stage colocated with another whose replica is one
  actor driving several GPUs (`sglang(tp = 2)  colocate = actor`). Ray
  cannot give one actor a fraction of several GPUs (RLP512), so such a
  file checked before `check` ran the launcher's layout but never
  launched; where one GPU's share holds the model, it is read as
  single-GPU replicas on the same GPUs (`tp = 1`), as the shipped OpenRLHF
  translation was rewritten: the same samples, each replica on one GPU.
  A vLLM replica leaves such GPUs to its engine's Ray workers
  (rldsl.layout), so `vllm(tp = 2)  colocate = actor` runs as written.

The other rules a shipped file met before they tightened keep their old
meaning where they run: RLP509 (GPUs shared across pipelines without
`share`, sharing.py) and RLP520 (logprob forwards past the GPU's memory,
memory_fit.py). tests/test_compat.py checks every file ever shipped.
"""

from __future__ import annotations

import dataclasses

from rldsl.compiler.decls import Decl, Pipeline, Program
from rldsl.compiler.diagnostics import WARNING, Diagnostic, Span
from rldsl.compiler.schema import ENGINES
from rldsl.compiler.types import Ref, arg_span
from rldsl.layout import RAY_WORKER_ENGINES

COLOCATED_SCORER = "RLP210"
SPLIT_REPLICAS = "RLP521"
BYTES_PER_PARAM = {"fp32": 4, "bf16": 2, "fp16": 2}
# Codes whose edit keeps the file's meaning: `rldsl fmt --fix` applies them (fmt.py).
KEPT_MEANINGS = ("RLP109", COLOCATED_SCORER, "RLP509", "RLP520", SPLIT_REPLICAS)


def keep_old_meanings(program: Program) -> tuple[Program, list[Diagnostic]]:
    """``program`` with each old form read as its current one, and a warning for each."""
    pipelines, found = [], []
    for pipe in program.pipelines:
        pipe, warnings = _colocated_scorers_take_weights(program, pipe)
        pipe, split = _colocated_replicas_split(program, pipe)
        pipelines.append(pipe)
        found += warnings + split
    return dataclasses.replace(program, pipelines=pipelines), found


def _colocated_scorers_take_weights(program: Program, pipe: Pipeline) -> tuple[Pipeline, list[Diagnostic]]:
    syncs = sorted(pipe.stages_of("sync"), key=lambda s: s.name)
    if not pipe.declarations_known or not all(s.valid("from", "to") for s in syncs):
        return pipe, []  # which stages a sync reaches is unknown: RLP205 is skipped too
    synced = {(s["from"].name, ref.name) for s in syncs for ref in s["to"]}
    stages, found = dict(pipe.stages), []
    for train in sorted(pipe.stages_of("train"), key=lambda s: s.name):
        own = next((s for s in syncs if s["from"].name == train.name), None)
        scorers = [s for s in sorted(pipe.stages_of("logprob"), key=lambda s: s.name)
                   if (train.name, s.name) not in synced and _scores_beside(pipe, s, train)]
        if own is None or not scorers or _reference_unfrozen(pipe, train):
            continue
        stages[own.name] = _with_targets(stages[own.name], scorers)
        targets = [ref.name for ref in own["to"]] + [s.name for s in scorers]
        edit = (own.span_of("to"), f"[{', '.join(targets)}]")
        found += [_warning(program, pipe, scorer, train, own, edit) for scorer in scorers]
    return dataclasses.replace(pipe, stages=stages), found


def _scores_beside(pipe: Pipeline, stage: Decl, train: Decl) -> bool:
    """A policy logprob stage of the trainer's model on the trainer's GPUs: the stage RLP205 once exempted."""
    if not stage.valid("frozen", "model", "colocate") or stage.get("frozen") or not train.valid("model"):
        return False
    model, trained = stage.get("model"), train.get("model")
    if model is None or trained is None or model.name != trained.name:
        return False
    colocated = stage.get("colocate") is not None and stage["colocate"].name == train.name
    placement = pipe.block("placement")
    groups = (placement.get("groups") or ()) if placement.valid("groups") else ()
    return colocated or any({stage.name, train.name} <= {ref.name for ref in group} for group in groups)


def _reference_unfrozen(pipe: Pipeline, train: Decl) -> bool:
    """The kl term needs a reference and no logprob stage is `frozen`: the scorer is most likely the reference
    written without `frozen` (RLP204 says so, and RLP205 follows), not a policy scorer to send weights to."""
    loss = train.get("loss") if train.valid("loss") else None
    scorers = pipe.stages_of("logprob")
    return bool(loss and loss.args.get("kl", 0) > 0) and all(s.valid("frozen") and not s.get("frozen")
                                                             for s in scorers)


def _with_targets(sync: Decl, scorers: list[Decl]) -> Decl:
    """The sync with ``scorers`` appended to its `to`, each pointing at its own declaration."""
    written = sync.settings["to"]
    refs = tuple(written.value) + tuple(Ref(s.name, s.name_span) for s in scorers)
    spans = tuple(written.item_spans) + tuple(s.name_span for s in scorers) if written.item_spans else ()
    return dataclasses.replace(sync, settings={**sync.settings, "to": written._replace(value=refs, item_spans=spans)})


def _warning(program: Program, pipe: Pipeline, scorer: Decl, train: Decl, sync: Decl,
             edit: tuple[Span, str]) -> Diagnostic:
    label = program.label(pipe.name, scorer.name)
    return Diagnostic(
        COLOCATED_SCORER, WARNING,
        f"{label} scores with the weights of {program.label(pipe.name, train.name)}, on whose GPUs it runs, but "
        f"no sync sends them: it is read as a target of sync `{sync.name}`", scorer.name_span,
        notes=("a policy logprob stage beside its trainer once needed no sync; it is a process of its own, and only "
               "a sync brings its weights up to date, so the trainer's sync now pushes each version to it",),
        help=f"add it to the `to` of sync `{sync.name}`: `to = {edit[1]}` (`rldsl fmt --fix` writes it)",
        edit=edit)



def _colocated_replicas_split(program: Program, pipe: Pipeline) -> tuple[Pipeline, list[Diagnostic]]:
    stages, found = dict(pipe.stages), []
    for stage in sorted(pipe.stages_of("generate"), key=lambda s: s.name):
        if not _one_actor_on_shared_gpus(stage) or not _one_gpu_holds_it(program, pipe, stage):
            continue
        engine = stage["engine"]
        tp = engine.args["tp"]
        split = engine._replace(args={**engine.args, "tp": 1})
        stages[stage.name] = dataclasses.replace(
            stage, settings={**stage.settings, "engine": stage.settings["engine"]._replace(value=split)})
        found.append(Diagnostic(
            SPLIT_REPLICAS, WARNING,
            f"{program.label(pipe.name, stage.name)} shares the GPUs of `{stage['colocate'].name}` with replicas of "
            f"{tp} GPUs, each one actor: it runs single-GPU replicas (`tp = 1`) on the same GPUs",
            arg_span(engine, "tp"),
            notes=("Ray gives an actor whole GPUs or a fraction of one, never a fraction of several (RLP512): the file "
                   "checked before `check` laid the plan out, but never launched",),
            help="write `tp = 1` (`rldsl fmt --fix` does), or give the replicas GPUs of their own",
            edit=(arg_span(engine, "tp"), "tp = 1")))
    return dataclasses.replace(pipe, stages=stages), found


def _one_actor_on_shared_gpus(stage: Decl) -> bool:
    """A colocated generate stage whose replica is one actor over tp > 1 GPUs (pp > 1 is another layout)."""
    if not stage.valid("engine", "colocate") or stage.get("colocate") is None or stage.get("engine") is None:
        return False
    engine = stage["engine"]
    if engine.name in RAY_WORKER_ENGINES:  # its engine's Ray workers take the shared GPUs (rldsl.layout)
        return False
    return "generate" in ENGINES[engine.name].replica_actor_kinds and engine.args.get("tp", 1) > 1 \
        and engine.args.get("pp", 1) == 1 and "tp" in (engine.arg_spans or {})


def _one_gpu_holds_it(program: Program, pipe: Pipeline, stage: Decl) -> bool:
    """A single-GPU replica holds the whole model in its share of the GPU: the weights take at most half of it,
    the rest being the KV cache's. Unknown (so no split) without the cluster's `gpu_memory` and the model's size:
    a model that needed tp > 1 to fit keeps RLP512."""
    capacity = program.cluster.get("gpu_memory") if program.cluster.valid("gpu_memory") else None
    ref = stage.get("model") if stage.valid("model") else None
    model = pipe.models.get(ref.name) if ref else None
    if not capacity or model is None or not model.valid("params", "dtype", "source"):
        return False
    from rldsl.compiler.memory import BUILTIN_PARAMS  # `check` loads the memory model only with a GPU size

    params = model.get("params") or BUILTIN_PARAMS.get(model["source"].removeprefix("builtin:"))
    engine = stage["engine"]
    weights = (params or 0) * BYTES_PER_PARAM[model.get("dtype") or engine.args.get("dtype", "bf16")]
    return bool(params) and weights <= engine.args.get("gpu_memory", 0.9) * capacity / 2
