"""Every finding has a help that is non-empty and true to the file, and its
caret underlines the one wrong thing, not a whole call."""

import re
from pathlib import Path

import pytest

from rldsl.compiler.diagnostics import source_lines
from rldsl.compiler.driver import compile_file, compile_source

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
BASE = (GOLDEN / "base.rlp").read_text()
GPU_CLUSTER = (ROOT / "pipelines" / "gpu_cluster.rlp").read_text()


def underlined(text: str, diagnostic) -> str:
    span = diagnostic.span
    return source_lines(text)[span.line - 1][span.col - 1:span.end_col - 1]


def only(text: str, code: str):
    found = [d for d in compile_source(text).diagnostics if d.code == code]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("RLP*.rlp")), ids=lambda p: p.stem)
def test_every_golden_finding_has_a_help_with_something_after_its_colon(path):
    for d in compile_file(path).diagnostics:
        assert d.help and d.help.strip(), d
        assert not d.help.rstrip().endswith(":"), d.help


def test_the_micro_batch_help_is_never_an_empty_list():
    """gpus = 10 with tp 2 is dp 5, which divides no batch of 512: no micro_batch can work."""
    text = GPU_CLUSTER.replace("  gpus = 8\n  prompts_per_step = 32", "  gpus = 10\n  prompts_per_step = 32")
    finding = only(text, "RLP302")
    assert "x 5 = 20" in finding.message and "micro_batch values" not in finding.help
    gpus, pps = re.search(r"on (\d+) GPUs", finding.help).group(1), re.search(r"prompts_per_step = (\d+)", finding.help)
    for fixed in (text.replace("  gpus = 10\n", f"  gpus = {gpus}\n"),
                  text.replace("prompts_per_step = 32", f"prompts_per_step = {pps.group(1)}")):
        assert "RLP302" not in {d.code for d in compile_source(fixed).diagnostics}  # the advice works


def test_the_micro_batch_help_lists_values_that_work():
    text = BASE.replace("  prompts_per_step = 8\n", "  prompts_per_step = 8\n  micro_batch = 3\n")
    values = re.search(r"divide it: ([\d, ]+)", only(text, "RLP302").help).group(1).split(", ")
    for value in values:
        fixed = text.replace("micro_batch = 3", f"micro_batch = {value}")
        assert "RLP302" not in {d.code for d in compile_source(fixed).diagnostics}


def test_the_kl_caret_underlines_the_argument_not_the_loss_call():
    text = BASE.replace("  prompts_per_step = 8\n", "  prompts_per_step = 8\n  loss = grpo(clip = 0.2, kl = 0.01)\n")
    assert underlined(text, only(text, "RLP204")) == "kl = 0.01"


@pytest.mark.parametrize(("engine", "code"), [("megatron(offload = true, tp = 4)", "RLP503"),
                                                ("megatron(offload = true, tp = 3)", "RLP502")])
def test_the_tp_caret_underlines_tp(engine, code):
    text = BASE.replace("nodes = 1  gpus_per_node = 4", "nodes = 3  gpus_per_node = 2") \
        .replace("  gpus = 2\n  prompts_per_step", f"  engine = {engine}\n  gpus = 4\n  prompts_per_step")
    assert underlined(text, only(text, code)) == engine.split(", ")[1].removesuffix(")")


def test_the_vllm_tp_caret_underlines_tp():
    text = BASE.replace("nodes = 1  gpus_per_node = 4", "nodes = 2  gpus_per_node = 2") \
        .replace("  gpus = 2\n  samples", "  engine = vllm(gpu_memory = 50%, tp = 4)\n  gpus = 4\n  samples") \
        .replace("  gpus = 2\n  prompts_per_step", "  colocate = rollout\n  prompts_per_step")
    assert underlined(text, only(text, "RLP503")) == "tp = 4"


def test_an_engine_that_cannot_run_the_stage_underlines_its_name():
    text = BASE.replace("  gpus = 2\n  prompts_per_step", "  engine = vllm(tp = 2)\n  gpus = 2\n  prompts_per_step")
    assert underlined(text, only(text, "RLP108")) == "vllm"


def test_the_offload_caret_and_help_name_the_engines_own_argument():
    text = BASE.replace("  gpus = 2\n  prompts_per_step", "  engine = torch(dtype = fp32, offload = false)\n"
                        "  colocate = rollout\n  prompts_per_step")
    finding = only(text, "RLP504")
    assert underlined(text, finding) == "offload = false"
    assert "torch(offload = true)" in finding.help and "sleep" not in finding.help


REFERENCE = "stage logprob reference { model = policy  frozen  colocate = actor }\n"
KL = ("  prompts_per_step = 8\n", "  prompts_per_step = 8\n  loss = grpo(kl = 0.01)\n")


def test_the_reference_help_says_the_flow_edge_is_missing_when_the_stage_exists():
    text = BASE.replace(*KL).replace("stage reward score", REFERENCE + "stage reward score")
    help_text = only(text, "RLP204").help
    assert help_text.startswith("put `reference` in a flow before `actor`") and "add `stage" not in help_text


def test_the_reference_help_says_frozen_is_missing_when_the_stage_is_the_policy():
    text = BASE.replace(*KL).replace("stage reward score", REFERENCE.replace("frozen  ", "") + "stage reward score") \
        .replace("score -> actor", "score -> reference -> actor")
    help_text = only(text, "RLP204").help
    assert "add `frozen` to `reference`" in help_text and "add `stage" not in help_text


def test_a_new_stage_suggested_by_a_help_gets_a_name_the_pipeline_does_not_use():
    text = BASE.replace(*KL).replace("model policy {", "model reference {") \
        .replace("model = policy", "model = reference")
    help_text = only(text, "RLP204").help
    assert "stage logprob reference2 { model = reference  frozen  colocate = actor }" in help_text


def test_the_sync_help_extends_the_trainers_sync_rather_than_adding_one():
    text = BASE.replace("stage sync weights { from = actor  to = rollout }",
                        "stage generate second { model = policy  gpus = 0  samples_per_prompt = 4 }\n"
                        "stage sync weights { from = actor  to = rollout }") \
        .replace("flow prompts -> rollout -> score -> actor", "flow prompts -> rollout -> score -> actor\n"
                                                              "flow prompts -> second -> score")
    assert only(text, "RLP205").help == "add it to the `to` of sync `weights`: `to = [rollout, second]`"


def test_every_bad_placement_share_is_reported_at_its_ratio():
    text = BASE.replace("  gpus = 2\n", "") \
        .replace("staleness", "stage logprob reference { model = policy  frozen }\n"
                 + "placement { groups = [actor, rollout, reference]  ratios = [30%, 30%, 40%] }\nstaleness") \
        .replace("score -> actor", "score -> reference -> actor")
    shares = [d for d in compile_source(text).diagnostics if d.code == "RLP507"]
    assert [underlined(text, d) for d in shares] == ["30%", "30%", "40%"]
    assert all("multiple of 25%" in d.help for d in shares)


def test_messages_in_a_multi_pipeline_file_name_the_pipeline():
    text = (ROOT / "pipelines" / "multi_pipeline_cpu.rlp").read_text() \
        .replace("gpus = [1]  samples_per_prompt = 8", "gpus = [1]  samples_per_prompt = 8  engine = megatron")
    text = text.replace("stage generate rollout { model = policy  engine = torch  gpus = [1]",
                        "stage generate rollout { model = policy  gpus = [1]")
    finding = only(text, "RLP108")
    assert "`reverse/rollout`" in finding.message
    text = (ROOT / "pipelines" / "multi_pipeline_cpu.rlp").read_text().replace("to = rollout }", "to = score }", 1)
    assert "`arith/rollout`" in only(text, "RLP205").message and "`arith/weights`" in only(text, "RLP206").message
