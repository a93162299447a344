"""Rule families are independent: every rule runs whenever its own inputs
resolved, so N independent problems give N findings in one run; a rule
whose input failed is skipped, never fed a stand-in value."""

from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source

BASE = (Path(__file__).parent / "golden" / "base.rlp").read_text()


def edit(text: str, *replacements: tuple[str, str]) -> str:
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def findings(text: str) -> list[tuple[str, str]]:
    return [(d.code, d.message) for d in compile_source(text).diagnostics]


# One problem per family, each in a different place of base.rlp.
INDEPENDENT = {
    "declarations": ("  samples_per_prompt = 4\n", "  samples_per_prompt = 4\n  temperature = \"hot\"\n"),
    "engines": ("stage generate rollout {\n  model = policy\n",
                "stage generate rollout {\n  model = policy\n  engine = megatron\n"),
    "fields": ("  prompts_per_step = 8\n", "  prompts_per_step = 8\n  loss = grpo(kl = 0.1)\n"),
    "batch sizes": ("  prompts_per_step = 8\n", "  prompts_per_step = 8\n  global_batch = 40\n"),
    "placement": ("  gpus = 2\n  prompts_per_step",
                  "  engine = torch(offload = true)\n  gpus = [1, 3, 5]\n  prompts_per_step"),
    "buffer": ("staleness { max_lag = 1 }", "staleness { max_lag = 1 }\nbuffer { capacity = 4 }"),
}
EXPECTED_CODES = {"declarations": "RLP104", "engines": "RLP108", "fields": "RLP204", "batch sizes": "RLP301",
                  "placement": "RLP501", "buffer": "RLP304"}


@pytest.mark.parametrize("family", sorted(INDEPENDENT))
def test_each_problem_alone_gives_its_one_finding(family):
    assert [code for code, _ in findings(edit(BASE, INDEPENDENT[family]))] == [EXPECTED_CODES[family]]


def test_a_file_with_a_problem_in_every_family_reports_each_of_them_sorted():
    text = edit(BASE, *INDEPENDENT.values())
    result = compile_source(text)
    alone = {f for family in INDEPENDENT for f in findings(edit(BASE, INDEPENDENT[family]))}
    assert {(d.code, d.message) for d in result.diagnostics} == alone
    assert len(result.diagnostics) == len(INDEPENDENT)
    assert [d.span for d in result.diagnostics] == sorted(d.span for d in result.diagnostics)


def test_a_failed_placement_group_leaves_its_stages_unplaced_not_one_gpu_each():
    """The stages of a group whose ratios fail were placed by their default `gpus = 1`: three stages on
    two GPUs then gave a false over-subscription."""
    text = edit(BASE, ("gpus_per_node = 4", "gpus_per_node = 2"),
                ("  model = policy\n  gpus = 2\n  samples", "  model = policy\n  samples"),
                ("  model = policy\n  gpus = 2\n  prompts", "  model = policy\n  prompts"),
                ("stage reward score", "stage logprob reference { model = policy  frozen }\nstage reward score"),
                ("rollout -> score", "rollout -> score -> reference"),
                ("staleness", "placement { groups = [[actor, reference], rollout]  ratios = [40%, 60%] }\nstaleness"))
    assert {code for code, _ in findings(text)} == {"RLP507"}


def test_the_batch_rule_uses_the_trainers_own_gpu_count_when_another_stage_is_unplaced():
    """rollout names a GPU beyond the cluster: the trainer placed by count after it is left unplaced, but
    its data-parallel size (2 GPUs, tp 1) is known, so RLP302 still runs with the true numbers."""
    text = edit(BASE, ("  gpus = 2\n  samples", "  gpus = [7]\n  samples"),
                ("  prompts_per_step = 8\n", "  prompts_per_step = 8\n  micro_batch = 3\n"))
    got = findings(text)
    assert [code for code, _ in got] == ["RLP501", "RLP302"]
    assert "micro_batch x dp = 3 x 2 = 6" in got[1][1]


HF_MODEL = 'model policy { source = "hf:/models/Qwen2.5-0.5B-Instruct"  params = 0.5B }'  # megatron loads one


def test_no_batch_finding_when_the_trainers_data_parallel_size_is_unknown():
    for engine in ("megatron(tp = 0)", "megatron(tp = 3)"):  # invalid (RLP106); 2 GPUs not a multiple of 3 (RLP502)
        text = edit(BASE, ('model policy { source = "builtin:tiny-lm" }', HF_MODEL),
                    ("  gpus = 2\n  prompts_per_step = 8\n",
                     f"  engine = {engine}\n  gpus = 2\n  prompts_per_step = 8\n  micro_batch = 32\n"))
        codes = [code for code, _ in findings(text)]
        assert "RLP302" not in codes and len(codes) == 1, codes


def test_a_stage_colocated_with_an_unplaced_stage_gets_no_second_finding():
    reference = "stage logprob reference { model = policy  frozen  colocate = actor }\n"
    text = edit(BASE, ('model policy { source = "builtin:tiny-lm" }', HF_MODEL),
                ("  gpus = 2\n  prompts_per_step", "  engine = megatron(tp = 4)\n  gpus = 2\n  prompts_per_step"),
                ("stage reward score", reference + "stage reward score"),
                ("rollout -> score", "rollout -> score -> reference"))
    assert [code for code, _ in findings(text)] == ["RLP502"]


def test_a_key_written_wrongly_is_not_also_missing():
    codes = [code for code, _ in findings(BASE.replace("samples_per_prompt = 4", "samples_per_prompt = 0"))]
    assert codes == ["RLP106"]


def test_a_misspelt_flow_name_is_reported_once_not_as_orphans_and_missing_fields():
    assert [code for code, _ in findings(BASE.replace("prompts -> rollout", "prompts -> rolout"))] == ["RLP101"]


def test_a_stage_declared_twice_is_left_out_not_judged_by_whichever_came_first():
    text = BASE.replace("stage reward score", "stage train score { model = policy  prompts_per_step = 0 }\n"
                                              "stage reward score", 1)
    codes = sorted(code for code, _ in findings(text))
    assert codes == ["RLP102", "RLP106"]  # no RLP208 (which `score` is meant is unknown)


def test_a_missing_cluster_still_lets_the_dataflow_rules_run():
    text = BASE.replace("cluster { nodes = 1  gpus_per_node = 4 }", "") \
        .replace("prompts -> rollout", "prompts -> actor -> rollout")
    codes = {code for code, _ in findings(text)}
    assert "RLP107" in codes and "RLP207" in codes and "RLP501" not in codes


def test_the_buffer_rules_run_when_the_dataflow_is_broken():
    text = edit(BASE, ("score -> actor", "score -> actor -> rollout"),
                ("staleness { max_lag = 1 }", "staleness { max_lag = 1 }\nbuffer { capacity = 2 }"))
    codes = [code for code, _ in findings(text)]
    assert "RLP201" in codes and "RLP304" in codes
