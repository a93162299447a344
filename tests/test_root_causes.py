"""A finding that explains others comes first, with them folded under it:
still counted, still failing `check`, in full with `--verbose` and in JSON,
and never an independent finding (issue #28)."""

import json
from pathlib import Path

from rldsl.cli import main
from rldsl.compiler.diagnostics import (ERROR, Consequence, Diagnostic, Span, order_by_cause, render_text,
                                        to_json)
from rldsl.compiler.driver import compile_file, compile_source
from rldsl.compiler.fmt import replace_span

CASE = Path(__file__).parent / "root_causes" / "two_pipelines_on_groups.rlp"


def apply(text: str, *diags) -> str:
    lines = text.split("\n")
    for d in sorted((d for d in diags if d.edit), key=lambda d: d.edit[0], reverse=True):
        lines = replace_span(lines, *d.edit)
    return "\n".join(lines)


def test_the_undeclared_overlap_comes_first_and_explains_what_follows_from_it():
    diags = compile_file(CASE).diagnostics
    assert sorted(d.code for d in diags) == ["RLP504"] * 4 + ["RLP506", "RLP509"]
    root = diags[0]
    assert root.code == "RLP509"
    assert all(d.explained_by == ("RLP509", root.span) for d in diags[1:])


def test_the_overlap_help_is_possible_with_placement_groups_and_leads_to_a_passing_file():
    result = compile_file(CASE)
    root = result.diagnostics[0]
    assert "otherwise give them separate GPUs" not in root.help  # groups always start at GPU 0
    assert "`gpus = [...]` ids" in root.help and "share = [a]" in root.help
    fixed = apply(result.source, *result.diagnostics)  # share = [a], and every engine sleeps or offloads
    assert compile_source(fixed).diagnostics == []


def test_an_overflow_that_one_pipeline_causes_alone_is_not_folded():
    """GPU 1 holds both trainers; with 1.5B parameters either alone is over 24GiB: that RLP506 is independent."""
    diags = compile_source(CASE.read_text().replace("params = 0.5B", "params = 1.5B")).diagnostics
    memory = {d.message.split(" needs")[0]: d for d in diags if d.code == "RLP506"}
    assert memory["GPU 0"].explained_by and memory["GPU 1"].explained_by is None


def test_a_stage_pair_within_one_pipeline_is_not_explained_by_the_overlap():
    text = CASE.read_text().replace(
        "  stage train actor { model = policy  engine = fsdp(offload = false)  prompts_per_step = 8 }\n"
        "  stage sync weights { from = actor  to = rollout }\n  flow prompts -> rollout -> score -> actor\n"
        "  placement { groups = [rollout, actor]  ratios = [50%, 50%] }",
        "  stage train actor { model = policy  engine = fsdp(offload = false)  prompts_per_step = 8 }\n"
        "  stage sync weights { from = actor  to = rollout }\n  flow prompts -> rollout -> score -> actor\n"
        "  placement { groups = [[rollout, actor]]  ratios = [100%] }", 1)
    inside = [d for d in compile_source(text).diagnostics if d.code == "RLP504" and "with `a/" in d.message
              and d.message.startswith("`a/")]
    assert inside and all(d.explained_by is None for d in inside)


def test_text_folds_the_consequences_under_the_root_and_verbose_shows_them_in_full():
    result = compile_file(CASE)
    short = render_text(result.diagnostics, result.source, "case.rlp")
    assert short.startswith("warning[RLP509]") and short.count("error[RLP504]:") == 0
    assert short.count("      error[RLP504] case.rlp:") == 4 and "--verbose" in short
    assert short.rstrip().endswith("5 errors, 1 warning (5 of them explained by another finding)")
    full = render_text(result.diagnostics, result.source, "case.rlp", verbose=True)
    assert full.count("error[RLP504]:") == 4 and full.count("follows from [RLP509]") == 5


def test_json_keeps_every_finding_and_names_its_root():
    result = compile_file(CASE)
    payload = to_json(result.diagnostics, "case.rlp")
    assert payload["error_count"] == 5 and not payload["valid"]  # RLP509 is a warning (an old meaning kept)
    explained = [d for d in payload["diagnostics"] if d["explained_by"]]
    assert len(explained) == 5 and {d["explained_by"]["code"] for d in explained} == {"RLP509"}


def test_check_fails_on_folded_errors_in_every_format(capsys):
    for argv in (["check", str(CASE)], ["check", "--verbose", str(CASE)], ["check", "--format", "json", str(CASE)]):
        assert main(argv) == 1
    assert json.loads(capsys.readouterr().out)["error_count"] == 5


def test_the_reference_slip_comes_before_the_missing_sync_it_causes():
    """A non-frozen logprob stage meant as the reference: RLP204 (no ref_logprobs) says `frozen`, and the
    RLP205 (a policy scorer takes weights) follows from the same slip, its help saying `frozen` first."""
    base = (Path(__file__).parent / "golden" / "base.rlp").read_text()
    text = base.replace("  prompts_per_step = 8\n", "  prompts_per_step = 8\n  loss = grpo(kl = 0.01)\n") \
        .replace("stage reward score", "stage logprob reference { model = policy  colocate = actor }\n"
                 "stage reward score").replace("score -> actor", "score -> reference -> actor")
    diags = compile_source(text).diagnostics
    assert [d.code for d in diags] == ["RLP204", "RLP205"] and diags[1].explained_by[0] == "RLP204"
    assert diags[1].help.startswith("if `reference` is the reference the kl term needs, mark it `frozen`")
    assert compile_source(apply(text, diags[0])).diagnostics == []


# ------------------------------------------------------- the mechanism alone


def finding(code: str, line: int, subject: str = "", explains=()) -> Diagnostic:
    return Diagnostic(code, ERROR, f"{code} at {line} {subject}", Span.point(line, 1), subject=subject,
                      explains=tuple(explains))


def test_order_by_cause_matches_code_span_and_subject_and_drops_nothing():
    root = finding("RLP509", 9, explains=[Consequence("RLP504", Span.point(2, 1), "a/x & b/x")])
    crossing, inside = finding("RLP504", 2, "a/x & b/x"), finding("RLP504", 2, "a/x & a/y")
    unrelated = finding("RLP301", 1)
    ordered = order_by_cause([unrelated, inside, crossing, root])
    assert [d.message for d in ordered] == [root.message, crossing.message, unrelated.message, inside.message]
    assert ordered[1].explained_by == ("RLP509", root.span)
    assert ordered[2].explained_by is None and ordered[3].explained_by is None


def test_order_by_cause_folds_a_chain_under_its_outermost_root_and_survives_a_cycle():
    a = finding("RLP100", 1, explains=[Consequence("RLP200", Span.point(2, 1))])
    b = finding("RLP200", 2, explains=[Consequence("RLP300", Span.point(3, 1)), Consequence("RLP100", a.span)])
    c = finding("RLP300", 3)
    ordered = order_by_cause([c, b, a])
    assert [d.code for d in ordered] == ["RLP100", "RLP200", "RLP300"]
    assert [d.explained_by for d in ordered] == [None, ("RLP100", a.span), ("RLP100", a.span)]
