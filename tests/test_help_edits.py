"""A help leads to a file that passes: the edit a finding carries (the one
`rldsl fmt --fix` would apply, see Diagnostic.edit), applied to its rule's
golden example, removes that finding and adds no error. Rules whose fix is
not one concrete value are listed in EXEMPT with the reason."""

from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.compiler.fmt import replace_span
from rldsl.compiler.rules.catalog import RULES

GOLDEN = Path(__file__).parent / "golden"

EXEMPT = {
    "RLP001": "a syntax error: what was meant is unknown",
    "RLP002": "nesting: the value must be rewritten by hand",
    "RLP003": "a long line: where to break it is a matter of layout",
    "RLP101": "a misspelt name: the nearest one is a guess, not a fix",
    "RLP102": "a duplicate: which one to keep is the author's choice",
    "RLP103": "a misspelt key: the nearest one is a guess, not a fix",
    "RLP104": "a value of the wrong type: its intended value is unknown",
    "RLP105": "a missing unit: which unit was meant is unknown",
    "RLP106": "out of range: the intended value is unknown",
    "RLP107": "a missing required value: only the author knows it",
    "RLP110": "two ways out (another `update`, or the torch engine): the author's choice",
    "RLP111": "two ways out (drop `recompute`, or drop `frozen` to score the policy): the author's choice",
    "RLP201": "a cycle: which edge is wrong is the author's choice",
    "RLP202": "an orphan: add it to a flow or remove it, the author's choice",
    "RLP203": "an unreachable stage: where its flow starts is the author's choice",
    "RLP204": "a missing producer: a new stage and a flow edge, more than one edit",
    "RLP207": "an edge between the wrong kinds: the intended flow is unknown",
    "RLP208": "a missing stage: a new declaration and a flow edge",
    "RLP209": "two changes: the generator's model and a new sync",
    "RLP309": "epochs and samples both written: which one to keep is the author's choice",
    "RLP310": "a weight per source: their values are the author's",
    "RLP313": "three ways out (no eval_source, a held-out file, eval_size = 0): the author's choice",
    "RLP501": "over-subscribed GPUs: which stage shrinks is the author's choice",
    "RLP502": "GPU count against tp x pp: either may change",
    "RLP503": "tp across nodes: tp or the stage's GPUs may change",
    "RLP505": "a partial overlap: the GPU ids of two stages, the author's choice",
    "RLP506": "memory: shard, offload or a larger GPU, a trade-off",
    "RLP507": "placement ratios: how to split the cluster is the author's choice",
    "RLP508": "colocation target: which stage to share with is the author's choice",
    "RLP512": "a multi-GPU replica sharing GPUs: tp or placement, the author's choice",
    "RLP515": "experts: ep, etp or the GPU count may change, or another engine; the author's choice",
    "RLP513": "a logprob stage on another pipeline's GPU: where it goes instead is the author's choice",
    "RLP514": "a generator several pipelines share: adapters on both, one base, or a generator of its own "
              "is the author's choice",
    "RLP319": "two ways out (drop the correction, or `recompute = behaviour`): the author's choice",
    "RLP113": "judge settings without a model: add a model or remove the settings, the author's choice",
    "RLP114": "a judge kind the model cannot serve: another model, engine or `judge`, the author's choice",
    "RLP115": "evaluation without the reward model: which `eval_metric` function is the author's choice",
    "RLP119": "a LoRA setting without a rank: adapters (which rank?) or full training is the author's choice",
    "RLP601": "a conversation past the context: turns, tokens per turn or `max_model_len`, a trade-off",
    "RLP602": "turns the budget cannot hold: `max_turns` or `max_tokens`, the author's choice",
    "RLP603": "an unused environment: use it or remove it, the author's choice",
    "RLP604": "a class that does not import: which class is meant is the author's",
    "RLP607": "tools without a format: which format (hermes, pythonic) the model writes is the model's",
    "RLP608": "a low straggler factor: how much variation the calls have is the author's knowledge",
}


def apply(text: str, edit) -> str:
    span, replacement = edit
    return "\n".join(replace_span(text.split("\n"), span, replacement))


def edited_cases():
    for path in sorted(GOLDEN.glob("RLP*.rlp")):
        text = path.read_text()
        for d in compile_source(text).diagnostics:
            if d.edit is not None:
                yield pytest.param(path.stem, text, d, id=f"{path.stem}-{d.code}-{d.span.line}:{d.span.col}")


@pytest.mark.parametrize(("golden", "text", "finding"), list(edited_cases()))
def test_the_edit_removes_its_finding_and_adds_no_error(golden, text, finding):
    before = compile_source(text).diagnostics
    after = compile_source(apply(text, finding.edit)).diagnostics
    count = lambda diags: sum(d.code == finding.code for d in diags)  # noqa: E731
    assert count(after) < count(before), (finding.help, [d.message for d in after if d.code == finding.code])
    new_errors = {d.code for d in after if d.is_error} - {d.code for d in before if d.is_error}
    assert not new_errors, [(d.code, d.message) for d in after if d.code in new_errors]


def test_every_rule_either_has_an_edit_in_its_golden_example_or_a_reason_not_to():
    with_edit = {code for code in RULES
                 if any(d.code == code and d.edit for d in compile_source((GOLDEN / f"{code}.rlp").read_text())
                        .diagnostics)}
    assert not with_edit & set(EXEMPT), with_edit & set(EXEMPT)
    assert sorted(with_edit | set(EXEMPT)) == sorted(RULES), sorted(set(RULES) - with_edit - set(EXEMPT))
    assert all(reason for reason in EXEMPT.values())


# ------------------------------------------------ helps that used to lead elsewhere

BASE = (GOLDEN / "base.rlp").read_text()
GPU_CLUSTER = (GOLDEN.parent.parent / "pipelines" / "gpu_cluster.rlp").read_text()


def codes(text: str) -> set[str]:
    return {d.code for d in compile_source(text).diagnostics}


def only(text: str, code: str):
    found = [d for d in compile_source(text).diagnostics if d.code == code]
    assert len(found) == 1, found
    return found[0]


def test_the_global_batch_list_keeps_the_nearest_value_and_only_values_the_micro_batch_rule_accepts():
    """120 prompts x 2 samples: twelve whole-group sizes; the first eight stop at 48, far from the 230
    written, and 2 or 6 would break RLP302 (micro_batch 2 x dp 2)."""
    text = BASE.replace("samples_per_prompt = 4", "samples_per_prompt = 2") \
        .replace("  prompts_per_step = 8\n", "  prompts_per_step = 120\n  global_batch = 230\n")
    finding = only(text, "RLP301")
    listed = [int(v) for v in finding.help.split(": ", 1)[1].split(";")[0].replace("...", "").split(",") if v.strip()]
    assert 240 in listed and finding.edit[1] == "240"
    for value in listed:
        assert not codes(text.replace("global_batch = 230", f"global_batch = {value}")) & {"RLP301", "RLP302"}


def test_the_data_parallel_help_never_asks_for_a_global_batch_no_minibatch_can_be():
    """dp 5 x micro_batch 4 = 20: no whole-group size of 16-sample groups dividing 512 is a multiple of 20."""
    text = GPU_CLUSTER.replace("  gpus = 8\n  prompts_per_step = 32", "  gpus = 10\n  prompts_per_step = 32\n"
                               "  global_batch = 256")
    finding = only(text, "RLP302")
    assert "multiple of" not in finding.help and "RLP301" not in codes(text)
    gpus = finding.help.split(" on ")[1].split(" GPUs")[0]
    assert not codes(text.replace("  gpus = 10\n", f"  gpus = {gpus}\n")) & {"RLP301", "RLP302"}


def test_the_one_sample_help_offers_reinforce_pp_only_with_the_normalisation_that_makes_it_work():
    text = BASE.replace("samples_per_prompt = 4", "samples_per_prompt = 1") \
        .replace("  prompts_per_step = 8\n", "  prompts_per_step = 8\n  normalize = group\n")
    finding = only(text, "RLP303")
    assert "advantage = reinforce_pp with normalize = batch" in finding.help
    switched = text.replace("  normalize = group\n", "  advantage = reinforce_pp\n  normalize = group\n")
    assert "RLP314" in codes(switched)  # the bare switch the help used to suggest does not work
    assert not codes(switched.replace("normalize = group", "normalize = batch"))
    assert not codes(apply(text, finding.edit))
