"""`placement { groups ratios }`: contiguous slices of the cluster, from GPU 0,
one per group (RLP507). Every problem is reported; when the slices cannot be
decided the members stay unplaced, never placed some other way."""

from __future__ import annotations

from typing import NamedTuple

from rldsl.compiler.decls import Decl, Pipeline, Program
from rldsl.compiler.diagnostics import ERROR, Diagnostic

_GPU_KINDS = ("generate", "logprob", "train")


class GroupPlan(NamedTuple):
    members: frozenset[str]  # every stage named in the groups
    slices: tuple[tuple[int, ...], ...]  # GPUs of each group, in order; empty when they cannot be decided
    placed: dict  # stage -> (its GPUs, its group partners), for the members without a problem of their own


def plan_groups(program: Program, pipe: Pipeline, total_gpus: int) -> tuple[GroupPlan | None, list[Diagnostic]]:
    """The groups' slices and findings; None when what the groups hold is unknown."""
    block = pipe.block("placement")
    if not block.valid("groups", "ratios"):
        return None, []
    groups, ratios = block.get("groups"), block.get("ratios")
    if groups is None and ratios is None:
        return GroupPlan(frozenset(), (), {}), []
    diags, refused = _member_problems(program, pipe, groups or ())
    slices = _slices(block, groups, ratios, total_gpus, diags)
    members = frozenset(ref.name for group in groups or () for ref in group)
    if slices is None:
        return GroupPlan(members, (), {}), diags
    placed = {}
    for group, gpus in zip(groups, slices):
        names = tuple(dict.fromkeys(ref.name for ref in group))
        for name in names:
            if name not in refused:
                placed[name] = (gpus, tuple(n for n in names if n != name))
    return GroupPlan(members, tuple(slices), placed), diags


def _member_problems(program: Program, pipe: Pipeline, groups) -> tuple[list[Diagnostic], set[str]]:
    """The findings about members, and the members they refuse."""
    out, seen, refused = [], set(), set()
    for group in groups:
        for ref in group:
            stage = pipe.stages[ref.name]
            label = program.label(pipe.name, ref.name)
            if ref.name in seen:
                out.append(Diagnostic("RLP507", ERROR, f"stage {label} is in two placement groups", ref.span,
                                      help=f"keep {label} in one group"))
            elif stage.explicit("gpus") or stage.explicit("colocate") or not stage.valid("gpus", "colocate"):
                key = "gpus" if stage.explicit("gpus") or not stage.valid("gpus") else "colocate"
                out.append(Diagnostic("RLP507", ERROR, f"stage {label} is in a placement group and also sets "
                                      f"`{key}`", stage.span_of(key), help=f"remove `{key}`: the group decides"))
            elif stage.stage_kind not in _GPU_KINDS and not (stage.stage_kind == "reward" and stage.get("model")):
                out.append(Diagnostic("RLP507", ERROR, f"stage {label} is a {stage.stage_kind} stage and "
                                      "uses no GPUs", ref.span, help="placement groups hold GPU stages: remove "
                                                                     f"{label} from `groups`"))
            else:
                seen.add(ref.name)
                continue
            seen.add(ref.name)
            refused.add(ref.name)
    return out, refused


def _slices(block: Decl, groups, ratios, total: int, diags: list[Diagnostic]) -> list[tuple[int, ...]] | None:
    """Each group's GPUs, or None (with the findings) when the ratios do not split the cluster."""
    if groups is None or ratios is None or len(groups) != len(ratios):
        span = block.span_of("ratios") if ratios is not None else block.span_of("groups")
        given = f"{len(groups or ())} group{'s' * (len(groups or ()) != 1)}, {len(ratios or ())} ratio" \
                f"{'s' * (len(ratios or ()) != 1)}"
        diags.append(Diagnostic("RLP507", ERROR, f"placement needs one ratio per group ({given})", span,
                                help="write `groups = [[a, b], c]  ratios = [50%, 50%]`"))
        return None
    ok = True
    if abs(sum(ratios) - 1.0) > 1e-6:
        ok = False
        diags.append(Diagnostic("RLP507", ERROR, f"placement ratios sum to {sum(ratios) * 100:.4g}%, not 100%",
                                block.span_of("ratios"),
                                help="the groups split the whole cluster: make the ratios add up to 100%"))
    step = f"{100 / total:.4g}%" if total else None
    for index, ratio in enumerate(ratios):
        share = ratio * total
        if abs(share - round(share)) > 1e-6 or round(share) == 0:
            ok = False
            what = "no GPU" if round(share) == 0 and abs(share) < 1e-6 else f"{share:g} GPUs, not a whole number"
            diags.append(Diagnostic("RLP507", ERROR, f"{ratio * 100:.4g}% of {total} GPUs is {what}",
                                    block.item_span("ratios", index),
                                    help=f"with {total} GPUs a group's share is a non-zero multiple of {step}"
                                    if step else "the cluster has no GPUs to split: remove the placement groups"))
    if not ok:
        return None
    out, cursor = [], 0
    for ratio in ratios:
        count = round(ratio * total)
        out.append(tuple(range(cursor, cursor + count)))
        cursor += count
    return out
