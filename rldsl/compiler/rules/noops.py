"""Settings that run but change nothing: warnings, since the run goes to its
end (`check --strict` fails them). A run that cannot move the policy
(RLP318: `lr = 0`; greedy sampling whose groups are all alike, so a group
baseline zeroes every advantage), and a rollout correction that weighs
every token 1 (RLP319: behaviour logprobs recomputed at the batch start)."""

from __future__ import annotations

from rldsl.compiler.context import Context
from rldsl.compiler.diagnostics import WARNING, Diagnostic
from rldsl.compiler.schema import GROUP_BASELINES
from rldsl.compiler.types import arg_span
from rldsl.launch_rules import TEXTLESS_ENGINES


def check_frozen_learning(ctx: Context) -> list[Diagnostic]:
    """RLP318: a learning rate of 0, or greedy samples compared with their group's baseline."""
    train = ctx.train_stage()
    if train is None:
        return []
    out = []
    if train.valid("lr") and train["lr"] == 0:
        out.append(Diagnostic("RLP318", WARNING, f"{ctx.label(train.name)} trains with lr = 0: every optimizer step "
                              "leaves the weights as they were", train.span_of("lr"),
                              help="set the learning rate the run should train with (the default is 1e-5)"))
    gen = ctx.generator_for(train)
    if gen is not None and gen.valid("temperature", "engine", "samples_per_prompt") and train.valid("advantage") \
            and gen["temperature"] == 0 and gen["engine"].name not in TEXTLESS_ENGINES \
            and gen["samples_per_prompt"] > 1 and train["advantage"] in GROUP_BASELINES:
        out.append(Diagnostic(
            "RLP318", WARNING, f"{ctx.label(gen.name)} samples greedily (temperature = 0), so the "
            f"{gen['samples_per_prompt']} samples of a prompt are one response repeated, and `advantage = "
            f"{train['advantage']}` subtracts their group's mean reward: every advantage is 0",
            gen.span_of("temperature"),
            notes=("the run goes to its end and the policy never moves; greedy decoding is for held-out "
                   "evaluation (`eval_temperature = 0`, the default)",),
            help="sample with a temperature above 0 (1.0, the default)", edit=(gen.span_of("temperature"), "1.0")))
    return out


def check_idle_correction(ctx: Context) -> list[Diagnostic]:
    """RLP319: a rollout correction against behaviour logprobs that a policy logprob stage recomputes
    with the trainer's batch-start weights, which are the proximal policy itself."""
    train = ctx.train_stage()
    if train is None or not train.valid("loss") or train["loss"].args.get("correction", "none") == "none":
        return []
    recomputing = sorted(s.name for s in ctx.pipe.stages_of("logprob") if s.valid("frozen", "recompute")
                         and not s.get("frozen") and s.get("recompute") == "batch_start")
    if not recomputing:
        return []
    loss = train["loss"]
    return [Diagnostic(
        "RLP319", WARNING, f"{ctx.label(train.name)}'s `correction = {loss.args['correction']}` weighs each token "
        f"by p_prox / p_behaviour, but {ctx.label(recomputing[0])} recomputes behaviour_logprobs with the "
        "trainer's weights at the step's start (`recompute = batch_start`), the proximal policy itself: every "
        "weight is 1 and the correction does nothing", arg_span(loss, "correction"),
        notes=("the generator's own logprobs, which the correction would compare with, are replaced by the "
               "recomputed ones",),
        help=f"drop the correction, or let `{recomputing[0]}` score each row at its generating version "
             "(`recompute = behaviour`, the default)")]


PASSES = (check_frozen_learning, check_idle_correction)
