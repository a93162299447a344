"""What `check` says of settings that run but do nothing (warnings that
`--strict` fails), of a number past ±1e18 (one finding, nothing hidden), of
a byte-order mark (accepted), and what RLP506's help offers (the levers
that move the estimate, never one already pulled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rldsl.cli import main
from rldsl.compiler.driver import compile_source

ROOT = Path(__file__).resolve().parent.parent
BASE = (ROOT / "tests" / "golden" / "base.rlp").read_text()
GPU_CLUSTER = (ROOT / "pipelines" / "gpu_cluster.rlp").read_text()


def edit(text: str, *replacements: tuple[str, str]) -> str:
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def findings(text: str) -> list[tuple[str, str, str]]:
    return [(d.code, d.severity, d.message) for d in compile_source(text).diagnostics]


def codes(text: str) -> list[str]:
    return [d.code for d in compile_source(text).diagnostics]


GEN, TRAIN = "  samples_per_prompt = 4\n", "  prompts_per_step = 8\n"


# ------------------------------------------------------------ no-op settings


def test_a_learning_rate_of_zero_is_a_warning_that_strict_fails(tmp_path, capsys):
    text = edit(BASE, (TRAIN, TRAIN + "  lr = 0\n"))
    ((code, severity, message),) = findings(text)
    assert (code, severity) == ("RLP318", "warning") and "lr = 0" in message
    (tmp_path / "p.rlp").write_text(text)
    assert main(["check", str(tmp_path / "p.rlp")]) == 0
    assert main(["check", "--strict", str(tmp_path / "p.rlp")]) == 1
    assert "warning[RLP318]" in capsys.readouterr().err


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_greedy_samples_with_a_group_baseline_are_a_warning(advantage):
    text = edit(BASE, (GEN, GEN + "  temperature = 0\n"), (TRAIN, TRAIN + f"  advantage = {advantage}\n"))
    assert codes(text) == ["RLP318"]
    assert codes(edit(text, ("temperature = 0", "temperature = 0.7"))) == []


def test_greedy_samples_without_a_baseline_or_a_group_are_left_alone():
    greedy = edit(BASE, (GEN, GEN + "  temperature = 0\n"))
    assert codes(edit(greedy, (TRAIN, TRAIN + "  advantage = reinforce_pp\n"))) == []  # no baseline: signal stays
    assert "RLP318" not in codes(edit(greedy, ("samples_per_prompt = 4", "samples_per_prompt = 1")))  # RLP303's
    sim = edit(greedy, (GEN, GEN + "  engine = sim\n"), (TRAIN, TRAIN + "  engine = sim\n"))
    assert codes(sim) == []  # sim draws token ids whatever the temperature


def test_a_correction_under_batch_start_recompute_is_a_warning():
    text = (ROOT / "tests" / "golden" / "RLP319.rlp").read_text()
    assert codes(text) == ["RLP319"]
    assert codes(edit(text, ("  recompute = batch_start", ""))) == []  # scores at the generating version: it acts
    assert codes(edit(text, ("loss = grpo(correction = tis)", "loss = grpo()"))) == []


# ------------------------------------------------------------------ numbers


HUGE = "100000000000000000000"
INDEPENDENT = [(GEN, GEN + "  temperature = \"hot\"\n"), (TRAIN, TRAIN + "  global_batch = 40\n"),
               ("staleness { max_lag = 1 }", "staleness { max_lag = 1 }\nbuffer { capacity = 4 }")]


def test_a_number_past_1e18_is_one_finding_and_hides_nothing():
    others = findings(edit(BASE, *INDEPENDENT))
    assert [c for c, _, _ in others] == ["RLP104", "RLP301", "RLP304"]
    text = edit(BASE, *INDEPENDENT, ("  gpus = 2\n  samples", f"  gpus = 2\n  max_new_tokens = {HUGE}\n  samples"))
    got = findings(text)
    huge = [f for f in got if f[2].startswith(f"`{HUGE}` is too large")]
    assert len(huge) == 1 and huge[0][0] == "RLP106"
    assert sorted(set(got) - set(huge)) == sorted(others)


@pytest.mark.parametrize("value", ["[0..1e30]", "vllm(tp = 1e20)", "[1, 2e19]", "-1e99"])
def test_a_huge_number_inside_a_value_leaves_only_its_key_invalid(value):
    if value.startswith("["):  # the rollout's own `gpus`
        text = edit(BASE, ("  gpus = 2\n  samples", f"  gpus = {value}\n  samples"))
    else:
        text = edit(BASE, (GEN, GEN + f"  {'engine' if value.startswith('vllm') else 'temperature'} = {value}\n"))
    got = findings(text)
    assert [c for c, _, _ in got] == ["RLP106"] and "too large" in got[0][2]


def test_two_huge_numbers_are_two_findings_in_file_order():
    text = edit(BASE, ("gpus_per_node = 4", "gpus_per_node = 1e19"), ("max_lag = 1", "max_lag = 1e19"))
    got = compile_source(text).diagnostics
    assert [d.code for d in got] == ["RLP106", "RLP106"] and got[0].span < got[1].span


# ------------------------------------------------------------ byte-order mark


def test_a_byte_order_mark_is_accepted_and_columns_are_an_editors(tmp_path):
    marked = "\ufeff" + BASE
    result = compile_source(marked)
    assert result.ok and not result.diagnostics
    assert result.plan.to_json() == compile_source(BASE).plan.to_json()
    wrong = compile_source("\ufeff" + BASE.replace("pipeline demo", "pipeline demo\nstage bogus x { }"))
    assert [(d.code, d.span.line, d.span.col) for d in wrong.diagnostics] == [("RLP103", 2, 7)]
    path = tmp_path / "bom.rlp"
    path.write_bytes(marked.encode("utf-8"))
    assert main(["check", str(path)]) == 0
    assert main(["check", str(path), "--set", "run.steps=3"]) == 0


# ------------------------------------------------------------------ RLP506


def memory_help(text: str) -> list[str]:
    return [d.help for d in compile_source(text).diagnostics if d.code == "RLP506"]


def test_the_memory_help_names_the_logprob_micro_batch_that_moves_the_estimate():
    (help_text,) = memory_help(edit(GPU_CLUSTER, ("gpu_memory = 80GiB", "gpu_memory = 40GiB")))
    assert help_text.startswith("lower `micro_batch` of `reference` (now 16 rows per forward)")
    assert "distributed_optimizer" not in help_text and "offload" not in help_text  # both already on


def test_the_memory_help_offers_no_tp_or_pp_to_fsdp():
    text = edit(GPU_CLUSTER, ("gpu_memory = 80GiB", "gpu_memory = 24GiB"),
                ("engine = megatron(tp = 2, pp = 1, offload = true, distributed_optimizer = true)",
                 "engine = fsdp"),
                ("engine = megatron(tp = 2, pp = 1, offload = true)\n  colocate", "engine = fsdp\n  colocate"))
    helps = memory_help(text)
    assert helps and not any("tp" in h or "pp" in h for h in helps), helps
    assert any("over more GPUs (fsdp shards over its ranks)" in h for h in helps)


def test_the_memory_help_offers_the_distributed_optimizer_only_when_it_is_off():
    text = edit(GPU_CLUSTER, ("gpu_memory = 80GiB", "gpu_memory = 24GiB"),
                ("distributed_optimizer = true", "distributed_optimizer = false"))
    assert any("`distributed_optimizer = true` on `actor`" in h for h in memory_help(text))


# -------------------------------------------------------------------- scale


def test_check_is_linear_in_the_clusters_size():
    """1024 nodes x 8 GPUs checks in well under 2 s on a quiet machine (bench/check_speed.py); 70 s when
    the lowering rebuilt the whole cluster's GPU map per GPU. The bound here is loose: the machine is shared."""
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("check_speed", ROOT / "bench" / "check_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    small, large = bench.cluster_pipeline(64), bench.cluster_pipeline(1024)
    compile_source(small, want_plan=False)
    start = time.perf_counter()
    result = compile_source(large, want_plan=False)
    assert result.ok and time.perf_counter() - start < 10
