"""LoRA (`lora_rank` on a model): a stage holding the adapters on an engine
that cannot train or serve them, with the launcher's own predicate
(rldsl/launch_rules.py, RLP118); adapter settings written without
`lora_rank`, which would train every weight (RLP119)."""

from __future__ import annotations

from rldsl.compiler.context import Context
from rldsl.compiler.diagnostics import ERROR, Diagnostic
from rldsl.compiler.schema import ENGINES
from rldsl.compiler.types import arg_span
from rldsl.launch_rules import LORA_SERVING_ENGINES, lora_refusal

ADAPTER_SETTINGS = ("lora_alpha", "lora_targets")  # mean nothing without `lora_rank`


def check_lora(ctx: Context) -> list[Diagnostic]:
    """RLP118: a stage holding a model's LoRA adapters on an engine without them; on a vLLM generator
    serving them, `update = interrupt` or a sleep that discards the base."""
    out = []
    for stage in ctx.pipe.stages.values():
        model = ctx.pipe.model_of(stage)
        engine = stage.engine_name
        if model is None or not model.valid("lora_rank") or not model.get("lora_rank") or engine is None \
                or stage.stage_kind not in ENGINES[engine].stage_kinds:  # else RLP108's
            continue
        update = stage.get("update") if stage.stage_kind == "generate" and stage.valid("update") else None
        spec = stage["engine"]
        sleep = int(spec.args.get("sleep", 0))
        why = lora_refusal(engine, stage.stage_kind, bool(stage.get("frozen", False)), update, sleep,
                           model["source"] if model.valid("source") else None)
        if not why:
            continue
        note = (f"model `{model.name}` declares `lora_rank = {model['lora_rank']}`",)
        if engine in LORA_SERVING_ENGINES and update == "interrupt":
            out.append(Diagnostic("RLP118", ERROR, f"{ctx.label(stage.name)}: {why}", stage.span_of("update"),
                                  notes=note, help="set `update = between_requests` (the default)",
                                  edit=(stage.span_of("update"), "between_requests")))
        elif engine in LORA_SERVING_ENGINES and sleep == 2:
            out.append(Diagnostic("RLP118", ERROR, f"{ctx.label(stage.name)}: {why}", arg_span(spec, "sleep"),
                                  notes=note, help="set `sleep = 1`: the base weights wait in host memory"))
        else:
            out.append(Diagnostic("RLP118", ERROR, f"{ctx.label(stage.name)}: {why}",
                                  spec.name_span or stage.span_of("engine"), notes=note,
                                  help="use `engine = torch` for this stage, or train every weight (remove "
                                       "`lora_rank`)",
                                  edit=(stage.span_of("engine"), "torch")))
    return out


def check_lora_settings(ctx: Context) -> list[Diagnostic]:
    """RLP119: `lora_alpha` or `lora_targets` on a model without `lora_rank`."""
    out = []
    for model in ctx.pipe.models.values():
        if not model.valid("lora_rank") or model.get("lora_rank"):
            continue
        for key in ADAPTER_SETTINGS:
            if model.valid(key) and model.get(key) is not None:
                out.append(Diagnostic("RLP119", ERROR, f"model `{model.name}` sets `{key}` but no `lora_rank`: "
                                      "every weight would train, and the setting would mean nothing",
                                      model.span_of(key),
                                      help=f"add `lora_rank = 8` (or another rank) to train adapters, or remove "
                                           f"`{key}`"))
    return out


PASSES = (check_lora, check_lora_settings)
