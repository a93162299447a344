"""Training-semantics rules: the loss's arguments, dynamic sampling
against the order, the run length, the dataset mixture, warmup.

Each reads only the keys it names, so one wrong key never hides another's
finding."""

from __future__ import annotations

import math

from rldsl.compiler.context import Context
from rldsl.compiler.decls import Decl
from rldsl.compiler.diagnostics import ERROR, WARNING, Diagnostic
from rldsl.compiler.types import arg_span

RUN_LENGTHS = ("steps", "epochs", "samples")


CORRECTION_DEFAULT_BOUNDS = {"is": (0.0, math.inf), "tis": (0.0, 2.0), "mis": (0.0, 2.0),
                             "icepop": (0.5, 5.0)}  # as the engines'


LOSS_BOUNDS = {  # argument: (what an active value must exceed, inclusive, why)
    "dual_clip": (1.0, False, "it caps a negative advantage's loss at dual_clip x |A|, above the clipped one"),
    "behaviour_cap": (1.0, True, "a weight cap below 1 would drop tokens the behaviour policy preferred"),
}


TYPICAL = {"dual_clip": 3.0, "behaviour_cap": 5.0}  # the value an RLP312 edit writes


def check_loss_arguments(ctx: Context) -> list[Diagnostic]:
    """RLP312: dual_clip and behaviour_cap are 0 (off) or above 1; a decay does not end above lr, a warmup
    does not start above it; Adam has two betas below 1."""
    train = ctx.train_stage()
    if train is None:
        return []
    out = _min_lr_findings(train) + _warmup_start_findings(train) + _adam_betas_findings(train) \
        + _difficulty_mask_findings(train)
    if not train.valid("loss"):
        return out
    out += _correction_findings(train["loss"]) + _aggregation_findings(train["loss"])
    for name, (bound, inclusive, why) in LOSS_BOUNDS.items():
        value = train["loss"].args.get(name, 0.0)
        if value and (value < bound or (value == bound and not inclusive)):
            relation = ">=" if inclusive else ">"
            out.append(Diagnostic("RLP312", ERROR, f"{name} = {value}: it must be 0 (off) or {relation} {bound:g}",
                                  arg_span(train["loss"], name), notes=(why,),
                                  help=f"leave {name} out, or set it {relation} {bound:g} (3.0 is typical for "
                                       "dual_clip, 5.0 for behaviour_cap)",
                                  edit=(arg_span(train["loss"], name), f"{name} = {TYPICAL.get(name, 0)}")))
    return out


def _correction_findings(loss) -> list[Diagnostic]:
    """A correction's bounds keep the on-policy weight 1; icepop is token-level; one token weighting at a time."""
    args = loss.args
    correction = args.get("correction", "none")
    if correction == "none":
        return []
    if args.get("behaviour_cap"):
        return [Diagnostic("RLP312", ERROR, f"behaviour_cap = {args['behaviour_cap']} and correction = {correction} "
                           "both weigh each token by pi_prox / pi_behaviour", arg_span(loss, "behaviour_cap"),
                           help="keep one: behaviour_cap = c is correction = mis with correction_high = c")]
    bounded = [key for key in ("correction_low", "correction_high") if key in args]
    if correction == "is" and bounded:
        return [Diagnostic("RLP312", ERROR, f"correction = is leaves the weight untruncated, but {bounded[0]} "
                           "bounds it", arg_span(loss, bounded[0]),
                           help="use correction = tis to truncate the weight at correction_high, or leave "
                                f"{' and '.join(bounded)} out")]
    if correction == "icepop" and args.get("correction_level") == "sequence":
        return [Diagnostic("RLP312", ERROR, "correction = icepop masks tokens, not sequences",
                           arg_span(loss, "correction_level"),
                           help="leave correction_level out, or use correction = mis for a sequence-level mask")]
    low, high = CORRECTION_DEFAULT_BOUNDS[correction]
    low, high = args.get("correction_low", low), args.get("correction_high", high)
    if low <= 1 <= high:
        return []
    wrong = "correction_low" if low > 1 else "correction_high"
    return [Diagnostic("RLP312", ERROR, f"correction bounds [{low:g}, {high:g}] leave out the weight 1",
                       arg_span(loss, wrong),
                       notes=("a token the generator and the trainer agree on has weight 1: a correction must keep "
                              "it whole",),
                       help="set correction_low at most 1 and correction_high at least 1 (2.0 is typical), "
                            "or leave them out")]


# loss arguments that act with some values of another only: argument -> (that argument, its default, the
# values it must take, what the first does)
ACTS_WITH = {
    "length_norm": ("agg", "token_mean", ("seq_mean_token_sum",),
                    "it divides the per-sequence token sums by a constant (Dr. GRPO)"),
    "count_masked": ("agg", "token_mean", ("seq_mean_token_sum", "seq_mean_token_mean"),
                     "it counts masked sequences in a sequence mean"),
    "kl_weighted": ("kl_in", "loss", ("loss",), "it weights the loss's KL term by the policy ratio"),
}


def _aggregation_findings(loss) -> list[Diagnostic]:
    """length_norm, count_masked and kl_weighted act on one aggregation or KL placement: elsewhere they
    would do nothing."""
    out = []
    for name, (other, default, needed, what) in ACTS_WITH.items():
        value = loss.args.get(other, default)
        if loss.args.get(name) and value not in needed:
            out.append(Diagnostic("RLP312", ERROR, f"{name} with {other} = {value}: {what}", arg_span(loss, name),
                                  help=f"use {other} = {needed[0]}, or leave {name} out"))
    return out


def _min_lr_findings(train: Decl) -> list[Diagnostic]:
    if not train.valid("lr", "min_lr", "lr_schedule") or train["lr_schedule"] == "constant" \
            or train["min_lr"] <= train["lr"]:
        return []
    return [Diagnostic("RLP312", ERROR, f"min_lr = {train['min_lr']} is above lr = {train['lr']}: a "
                       f"{train['lr_schedule']} decay would rise", train.span_of("min_lr"),
                       help=f"set min_lr below {train['lr']} (a tenth of it is typical), or leave it out",
                       edit=(train.span_of("min_lr"), f"{train['lr'] / 10:g}"))]


def _warmup_start_findings(train: Decl) -> list[Diagnostic]:
    if not train.valid("lr", "warmup_start_lr") or train["warmup_start_lr"] <= train["lr"]:
        return []
    return [Diagnostic("RLP312", ERROR, f"warmup_start_lr = {train['warmup_start_lr']} is above lr = {train['lr']}: "
                       "the warmup would fall", train.span_of("warmup_start_lr"),
                       help=f"set warmup_start_lr below {train['lr']} (a tenth of it is typical), or leave it out")]


def _adam_betas_findings(train: Decl) -> list[Diagnostic]:
    betas = train.get("adam_betas") if train.valid("adam_betas") else None
    if betas is None or (len(betas) == 2 and all(beta < 1 for beta in betas)):
        return []
    written = ", ".join(f"{beta:g}" for beta in betas)
    return [Diagnostic("RLP312", ERROR, f"adam_betas = [{written}]: Adam takes two betas, each in [0, 1)",
                       train.span_of("adam_betas"),
                       notes=("beta1 averages the gradients, beta2 their squares; a beta of 1 never forgets",),
                       help="write two values below 1, such as `adam_betas = [0.9, 0.95]`, or leave it out for "
                            "the engine's")]


def _difficulty_mask_findings(train: Decl) -> list[Diagnostic]:
    bounds = train.get("difficulty_mask") if train.valid("difficulty_mask") else None
    if bounds is None or len(bounds) == 2:
        return []
    written = ", ".join(f"{bound:g}" for bound in bounds)
    return [Diagnostic("RLP312", ERROR, f"difficulty_mask = [{written}]: it takes two bounds, `[low, high]`",
                       train.span_of("difficulty_mask"),
                       notes=("a prompt group whose mean reward is not strictly between low and high is masked "
                              "out of the loss",),
                       help="write two values, such as `difficulty_mask = [0.1, 0.95]`, or leave it out")]


def check_dynamic_sampling(ctx: Context) -> list[Diagnostic]:
    """RLP308: dropped groups are replaced by over-sampling, which an
    in-order step (exactly its own prompts) or a one-sample group cannot do."""
    train = ctx.train_stage()
    if train is None or not train.valid("dynamic_sampling") or not train["dynamic_sampling"]:
        return []
    out = []
    staleness = ctx.pipe.block("staleness")
    if staleness.valid("order") and staleness["order"] == "in_order":
        out.append(Diagnostic(
            "RLP308", ERROR, "dynamic_sampling with order = in_order: a step whose groups are dropped cannot be "
            "refilled", train.span_of("dynamic_sampling"),
            notes=("an in-order step trains exactly its own prompts, so every dropped group leaves it short",),
            help="use order = any (the default), or leave dynamic_sampling out",
            edit=(staleness.span_of("order"), "any")))
    gen = ctx.generator_for(train)
    if gen is not None and gen.valid("samples_per_prompt") and gen["samples_per_prompt"] < 2:
        out.append(Diagnostic(
            "RLP308", ERROR, f"dynamic_sampling with samples_per_prompt = {gen['samples_per_prompt']}: every group "
            "has one reward, so every group would be dropped", train.span_of("dynamic_sampling"),
            help="sample at least 2 responses per prompt, or leave dynamic_sampling out"))
    return out


def check_run_length(ctx: Context) -> list[Diagnostic]:
    """RLP309: the data the run trains on is counted one way. `steps` beside
    `epochs` or `samples` is a cap (whichever is reached first ends the run);
    `epochs` and `samples` both count the data, so one of them."""
    run = ctx.pipe.block("run")
    if not (run.explicit("epochs") and run.explicit("samples")):
        return []
    return [Diagnostic("RLP309", ERROR, f"the run's length is written in both epochs and samples: "
                       f"epochs = {run.get('epochs')}, samples = {run.get('samples')}", run.span_of("samples"),
                       notes=("`steps` may stand beside either as a cap: the run ends at whichever bound it "
                              "reaches first",),
                       help="keep one of epochs, samples")]


def check_datasets(ctx: Context) -> list[Diagnostic]:
    """RLP310: a dataset names its prompts once, and a mixture's weights match its sources."""
    out = []
    for dataset in ctx.pipe.datasets.values():
        out += _dataset_findings(dataset)
    return out


def _dataset_findings(dataset: Decl) -> list[Diagnostic]:
    if not dataset.valid("source", "sources", "weights"):
        return []
    name = f"dataset `{dataset.name}`"
    has_one, has_many = dataset.explicit("source"), dataset.explicit("sources")
    if has_one == has_many:
        return [Diagnostic("RLP310", ERROR, f"{name} sets both `source` and `sources`" if has_one else
                           f"{name} has neither `source` nor `sources`",
                           dataset.span_of("sources") if has_one else dataset.name_span,
                           help='write `source = "builtin:arith"`, or a mixture: '
                                '`sources = ["builtin:arith", "builtin:reverse"]  weights = [3, 1]`')]
    weights = dataset.get("weights")
    if weights is None:
        return []
    count = len(dataset.get("sources") or (dataset["source"],))
    if len(weights) != count:
        return [Diagnostic("RLP310", ERROR, f"{name} has {len(weights)} weights for {count} source"
                           f"{'s' * (count != 1)}", dataset.span_of("weights"),
                           help="give one weight per source, in the same order")]
    if not any(weights):
        return [Diagnostic("RLP310", ERROR, f"{name}: every weight is 0, so no prompt can be drawn",
                           dataset.span_of("weights"), help="give at least one source a positive weight")]
    return []


def check_warmup(ctx: Context) -> list[Diagnostic]:
    """RLP311: warmup longer than the run never reaches the learning rate."""
    sizing, train, run = ctx.sizing(), ctx.train_stage(), ctx.pipe.block("run")
    if sizing is None or train is None or not train.valid("warmup", "ppo_epochs") \
            or not run.valid(*RUN_LENGTHS) or (run.get("epochs") and not run.explicit("steps")):
        return []
    rollout = sizing.prompts_per_step * sizing.samples_per_prompt
    total = _most_steps(run, rollout) * rollout // sizing.global_batch * sizing.ppo_epochs
    if train["warmup"] < total:
        return []
    takes = "at most" if run.get("epochs") else "only"  # an epoch may end the run before its `steps`
    return [Diagnostic("RLP311", WARNING, f"warmup = {train['warmup']} optimizer steps, but the run takes {takes} "
                       f"{total}: the learning rate never reaches lr = {train.get('lr')}", train.span_of("warmup"),
                       notes=("warmup counts optimizer steps: rollout batches x (rollout batch / global_batch) x "
                              "ppo_epochs",),
                       help=f"set warmup below {total} (a few percent of the run is typical)",
                       edit=(train.span_of("warmup"), str(total // 20)))]


def _most_steps(run: Decl, rollout: int) -> int:
    """The steps the run takes at most, as written: `steps`, those of
    `samples`, or the fewer of the two when both are written (a run in
    `epochs` is bounded by its `steps` alone before the dataset is read)."""
    bounds = [run["steps"]] if run.explicit("steps") or not (run.get("epochs") or run.get("samples")) else []
    if run.get("samples"):
        bounds.append(-(-int(run["samples"]) // rollout))
    return min(bounds)


def check_held_out(ctx: Context) -> list[Diagnostic]:
    """RLP313: an `eval_source` that is one of the training files."""
    out = []
    for dataset in ctx.pipe.datasets.values():
        if not dataset.valid("source", "sources", "eval_source", "eval_size") or not dataset.get("eval_size"):
            continue
        evaluated, trained = dataset.get("eval_source"), dataset.get("sources") or [dataset.get("source")]
        if evaluated is None or evaluated not in trained or "{split}" in evaluated:
            continue
        out.append(Diagnostic(
            "RLP313", WARNING, f"dataset `{dataset.name}` evaluates on its training prompts: `eval_source` is "
            f"`{evaluated}`, which training reads whole", dataset.span_of("eval_source"),
            notes=("the reported held-out accuracy would be accuracy on prompts the policy trained on",),
            help="leave `eval_source` out (a file without `{split}` then holds out about 5% of its rows, by "
                 'prompt hash, which training never sees), name a held-out file (`eval_source = '
                 '"jsonl:heldout.jsonl"`), or set `eval_size = 0`'))
    return out


PASSES = (check_loss_arguments, check_dynamic_sampling, check_run_length, check_datasets,
          check_warmup, check_held_out)
