"""Weight rules: syncs join a trainer and the generators of its model, and
generation runs the model being trained (the RL loop closes)."""

from __future__ import annotations

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl
from rldsl.compiler.diagnostics import ERROR, Diagnostic, Span
from rldsl.compiler.placement import server_of
from rldsl.compiler.rules.advice import free_name, frozen_edit, unfrozen_reference
from rldsl.collective_rule import WeightReceiver, collective_blocker
from rldsl.plan import receives_weights


def _model(stage: Decl) -> str | None:
    return stage["model"].name if stage.valid("model") and stage.get("model") else None


def _receives_weights(stage: Decl) -> bool:
    return receives_weights(stage.stage_kind, bool(stage.get("frozen")))


def _weights_known(stage: Decl) -> bool:
    """Whether it is known if the stage takes weights (a logprob stage's `frozen` resolved)."""
    return stage.stage_kind != "logprob" or stage.valid("frozen")


def check_sync(ctx: Context) -> list[Diagnostic]:
    """RLP206: syncs go from a train stage to generators of the same model."""
    out, pipe = [], ctx.pipe
    trains = sorted(s.name for s in pipe.stages_of("train"))
    for sync in pipe.stages_of("sync"):
        if not sync.valid("from"):
            continue
        src = sync["from"]
        source = pipe.stages[src.name]
        if source.stage_kind != "train":
            edit = _redirect(ctx, sync, trains[0]) if trains else None
            fix = f"`from = {trains[0]}`" if trains else "`from` names a train stage"
            if edit:
                first, second = sorted((sync.span_of("from"), sync.span_of("to")))
                fix = f"`{'from' if first == sync.span_of('from') else 'to'} = {edit[1]}`"
            out.append(Diagnostic("RLP206", ERROR, f"sync {ctx.label(sync.name)} sends weights from "
                                  f"{ctx.label(source.name)}, a {source.stage_kind} stage", src.span,
                                  help=f"weights come from the trainer: {fix}", edit=edit))
            continue
        for ref in sync["to"] if sync.valid("to") else ():
            out += _target_findings(ctx, sync, source, pipe.stages[ref.name], ref)
    return out


def _target_findings(ctx: Context, sync: Decl, source: Decl, target: Decl, ref) -> list[Diagnostic]:
    if not _weights_known(target):
        return []
    if not _receives_weights(target):
        why = "a frozen reference keeps its weights" if target.stage_kind == "logprob" else \
            "`to` names generate stages (or policy logprob stages)"
        return [Diagnostic("RLP206", ERROR, f"sync {ctx.label(sync.name)} sends weights to {ctx.label(target.name)}, "
                           f"a {_describe(target)}", ref.span, help=f"{why}: remove `{target.name}` from `to`")]
    sent, runs = _model(source), _model(target)
    if sent and runs and sent != runs:
        return [Diagnostic("RLP206", ERROR, f"sync {ctx.label(sync.name)} sends `{sent}` weights to "
                           f"{ctx.label(target.name)}, which runs model `{runs}`", ref.span,
                           help=f"a sync joins a trainer and generators of the same model: set `model = {sent}` "
                                f"in `{target.name}`, or remove it from `to`",
                           edit=(target.span_of("model"), sent))]
    return []


def _redirect(ctx: Context, sync: Decl, train: str, also: str | None = None) -> tuple[Span, str] | None:
    """A sync written the wrong way round (`from = rollout  to = actor`) turned around: `from` the trainer,
    `to` the stages of its `to` and its old `from` (and ``also``) that take weights. One edit over the
    written `from ... to ...` (or `to ... from ...`); None when no receiver is left."""
    if not sync.valid("to", "from"):
        return None
    names = [ref.name for ref in sync["to"]] + [sync["from"].name] + ([also] if also else [])
    targets = list(dict.fromkeys(n for n in names if n != train and _weights_known(ctx.pipe.stages[n])
                                 and _receives_weights(ctx.pipe.stages[n])))
    if not targets:
        return None
    to = targets[0] if len(targets) == 1 else f"[{', '.join(targets)}]"
    first, second = sorted((sync.span_of("from"), sync.span_of("to")))
    text = f"{train}  to = {to}" if first == sync.span_of("from") else f"{to}  from = {train}"
    return Span(first.line, first.col, second.end_line, second.end_col), text


def _describe(stage: Decl) -> str:
    if stage.stage_kind == "logprob" and stage.get("frozen"):
        return "frozen logprob stage"
    return f"{stage.stage_kind} stage"


def _synced(ctx: Context) -> set[tuple[str, str]] | None:
    """(train, target) pairs joined by a sync; None when a sync did not resolve."""
    syncs = ctx.pipe.stages_of("sync")
    if not all(s.valid("from", "to") for s in syncs):
        return None
    return {(s["from"].name, ref.name) for s in syncs for ref in s["to"]}


def check_missing_syncs(ctx: Context) -> list[Diagnostic]:
    """RLP205: every generator and policy logprob stage of a trained model receives a sync.

    A policy logprob stage on the trainer's own GPUs is no exception: it is
    a process of its own with its own copy of the weights, which only a sync
    brings up to date (rldsl.plan.receives_weights is the runtime's side)."""
    pipe = ctx.pipe
    synced = _synced(ctx)
    if synced is None or not pipe.declarations_known:  # a dropped block may be the sync
        return []
    out = []
    for train in pipe.stages_of("train"):
        model = _model(train)
        for stage in pipe.stages.values():
            if model is None or not _weights_known(stage) or not _receives_weights(stage) or _model(stage) != model:
                continue
            if (train.name, stage.name) not in synced:
                help_text, edit = _sync_help(ctx, train, stage)
                out.append(Diagnostic("RLP205", ERROR, f"{ctx.label(stage.name)} runs model `{model}`, which "
                                      f"{ctx.label(train.name)} trains, but receives no weight sync",
                                      stage.name_span, help=help_text, edit=edit))
    return out


def _sync_help(ctx: Context, train: Decl, stage: Decl) -> tuple[str, tuple[Span, str]]:
    """The help and its edit. A policy scorer where the trainer's kl needs a reference and none is frozen
    is most likely that reference: `frozen` comes first (RLP204 says the same)."""
    syncs = sorted(ctx.pipe.stages_of("sync"), key=lambda s: s.name)
    own = [s for s in syncs if s["from"].name == train.name]
    if own:
        targets = ", ".join([ref.name for ref in own[0]["to"]] + [stage.name])
        sync = (f"add it to the `to` of sync `{own[0].name}`: `to = [{targets}]`",
                (own[0].span_of("to"), f"[{targets}]"))
    elif misdirected := [s for s in syncs if ctx.pipe.stages[s["from"].name].stage_kind != "train"]:
        # RLP206 reports it: that sync is meant to be this one
        edit = _redirect(ctx, misdirected[0], train.name, also=stage.name)
        sync = (f"send the weights from the trainer: `stage sync {misdirected[0].name} {{ from = {train.name}  "
                f"to = {stage.name} }}`", edit)
    else:
        text = f"stage sync {free_name(ctx.pipe, 'weights')} {{ from = {train.name}  to = {stage.name} }}"
        end = train.span
        sync = f"add `{text}`", (Span(end.end_line, end.end_col, end.end_line, end.end_col), "\n" + text)
    reference = unfrozen_reference(ctx, train)
    if reference is not None and reference.name == stage.name:
        return (f"if `{stage.name}` is the reference the kl term needs, mark it `frozen` (a frozen stage takes no "
                f"weights); otherwise {sync[0]}", frozen_edit(stage))
    return sync


def check_trained_generation(ctx: Context) -> list[Diagnostic]:
    """RLP209: the trainer's generators run the model it trains, or its updates never reach generation."""
    train = ctx.train_stage()
    model = train and _model(train)
    synced = _synced(ctx)
    if model is None or synced is None or not ctx.pipe.dataflow_known:
        return []
    upstream = ctx.upstream(train.name)
    generators = sorted((s for s in ctx.pipe.stages_of("generate") if s.name in upstream), key=lambda s: s.name)
    models = [_model(g) for g in generators]
    if not generators or None in models or model in models:
        return []
    if any((train.name, g.name) in synced for g in generators):
        return []  # RLP206 reports the sync across models
    runs = ", ".join(f"`{g.name}` runs `{m}`" for g, m in zip(generators, models))
    first = generators[0]
    return [Diagnostic("RLP209", ERROR, f"{ctx.label(train.name)} trains model `{model}`, but generation never "
                       f"uses it: {runs}", first.span_of("model"),
                       notes=("every step trains on samples from a model the trainer does not update: the RL "
                              + "loop never closes",),
                       related=((train.span_of("model"), "the model trained"),),
                       help=f"generate from the trained model, `model = {model}` in `{first.name}`, and send it the "
                            f"weights: `stage sync {free_name(ctx.pipe, 'weights')} {{ from = {train.name}  "
                            f"to = {first.name} }}`")]


PASSES = (check_sync, check_missing_syncs, check_trained_generation)

def check_transport(ctx: Context) -> list[Diagnostic]:
    """RLP511: `transport = collective` only where every receiver can take
    part in a collective whenever a version is ready."""
    out = []
    for sync in ctx.pipe.stages_of("sync"):
        if not sync.valid("transport", "from", "to") or sync.get("transport") != "collective":
            continue
        blocker = _collective_blocker(ctx, sync)
        if blocker:
            out.append(Diagnostic(
                "RLP511", ERROR, f"sync {ctx.label(sync.name)} asks for `transport = collective`, but {blocker}",
                sync.span_of("transport"),
                notes=("a collective push streams each version to every receiver at once; a receiver must be a "
                       "generate stage on an engine that applies a stream between two batches, and awake",),
                help="use `transport = auto`, which goes rank to rank only where it can, or `object_store`",
                edit=(sync.span_of("transport"), "auto")))
    return out


def _collective_blocker(ctx: Context, sync: Decl) -> str | None:
    source = ctx.pipe.stages[sync["from"].name]
    trainer_gpus = _gpus(ctx, source.name)
    receivers = [WeightReceiver(ref.name, target.stage_kind, target.engine_name,
                                bool(trainer_gpus & _gpus(ctx, ref.name)), server_of(target))
                 for ref in sync["to"] for target in (ctx.pipe.stages[ref.name],)]
    return collective_blocker(source.name, source.engine_name, receivers, _takes_leases(ctx, source.name))


def _takes_leases(ctx: Context, trainer: str) -> bool:
    """The trainer or a generator holds a GPU another pipeline uses: it then runs only while it holds
    the GPU's lease, so receivers sleep between turns (the launcher's `receivers_sleep`)."""
    if ctx.placement is None:
        return False
    others = {gpu for (pipeline, _), placed in ctx.placement.stages.items() if pipeline != ctx.pipe.name
              for gpu in placed.gpus}
    mine = _gpus(ctx, trainer).union(*(_gpus(ctx, g.name) for g in ctx.pipe.stages_of("generate")))
    return bool(mine & others)


def _gpus(ctx: Context, stage: str) -> set[int]:
    placed = ctx.placement.stages.get((ctx.pipe.name, stage)) if ctx.placement else None
    return set(placed.gpus) if placed else set()
