"""Parser and resolver behaviour beyond the per-rule goldens."""

from rldsl.compiler.driver import compile_source
from rldsl.compiler.parser import parse

GOOD = '''
pipeline p
cluster { gpus_per_node = 2 }
'''


def codes(text):
    return [d.code for d in compile_source(text).diagnostics]


def test_units_and_values_parse():
    tree, diags = parse('pipeline p\nx { a = 256MiB b = 30s c = 50% d = 1.5B e = 1e-5 f = [0..1, 3] g = "s" h = n(k = 1) flag }')
    assert not diags
    entries = {e.key.text: e.value for e in tree.pipelines[0].blocks[0].entries}
    assert entries["a"].unit == "MiB" and entries["b"].unit == "s" and entries["c"].unit == "%"
    assert entries["e"].unit == "" and entries["e"].magnitude == 1e-5
    assert entries["flag"] is None


def test_unclosed_brace_points_at_the_opener():
    result = compile_source("pipeline p\ncluster {\n  gpus_per_node = 2\n")
    (diag,) = result.diagnostics
    assert diag.code == "RLP001" and diag.span.line == 2 and "never closed" in diag.message


def test_unterminated_string():
    (diag,) = compile_source('pipeline p\nmodel m { source = "abc }\n').diagnostics
    assert "unterminated string" in diag.message


def test_header_and_block_forms_cannot_mix():
    assert codes("pipeline a\npipeline b { }\ncluster { gpus_per_node = 1 }") == ["RLP001"]


def test_all_resolve_findings_in_one_run():
    text = GOOD + '''
model m { source = "builtin:tiny-lm"  sauce = 1 }
stage generate g { model = mm  samples_per_prompt = -1  temperatur = 1 }
'''
    found = codes(text)
    assert found.count("RLP103") == 2 and "RLP101" in found and "RLP106" in found


def test_unknown_unit_suggests():
    (diag,) = [d for d in compile_source(GOOD + "stage sync s { from = a  to = b  bucket = 256Mib }").diagnostics
               if d.code == "RLP105"]
    assert "MiB" in diag.help


def test_bare_flag_means_true():
    text = open("tests/golden/base.rlp").read().replace(
        "stage train", "stage logprob reference { model = policy  frozen  colocate = actor }\nstage train").replace(
        "score -> actor", "score -> reference -> actor")
    result = compile_source(text)
    assert result.ok, result.diagnostics
    ref = result.plan.pipeline().stage("reference")
    assert ref.settings["frozen"] is True and ref.colocated_with == ["actor"]


def test_sorted_by_position():
    text = GOOD + 'model m { source = 1 }\nmodel n { source = 2 }\n'
    lines = [d.span.line for d in compile_source(text).diagnostics]
    assert lines == sorted(lines)


BASE = open("tests/golden/base.rlp").read()


def _codes_after(*pairs):
    text = BASE
    for old, new in pairs:
        text = text.replace(old, new, 1)
    return codes(text)


def test_empty_gpu_list_is_rejected():
    assert "RLP104" in _codes_after(("  gpus = 2\n  samples", "  gpus = []\n  samples"))


def test_sync_stage_in_a_flow_is_rejected():
    assert "RLP207" in _codes_after(("score -> actor", "score -> weights -> actor"))


def test_grouped_stage_cannot_also_set_gpus():
    found = _codes_after(("staleness { max_lag = 1 }",
                          "staleness { max_lag = 1 }\nplacement { groups = [actor, rollout]  ratios = [50%, 50%] }"))
    assert "RLP507" in found


def test_colocation_chains_resolve_in_any_order():
    chain = ("stage train", "stage logprob ref2 { model = policy  frozen  colocate = ref1 }\n"
                            "stage logprob ref1 { model = policy  frozen  colocate = actor }\nstage train")
    result = compile_source(BASE.replace(*chain).replace("score -> actor", "score -> ref1 -> ref2 -> actor"))
    assert result.ok, result.diagnostics
    assert result.plan.pipeline().stage("ref2").colocated_with == ["actor", "ref1"]


def test_sizes_are_whole_bytes_in_the_plan():
    result = compile_source(BASE.replace("to = rollout }", "to = rollout  bucket = 1.5MiB }"))
    assert result.plan.pipeline().stage("weights").settings["bucket"] == 1572864


def test_a_megatron_logprob_stage_with_pipeline_parallelism_checks_and_plans_pp_groups():
    """MegatronLogprob runs the forward-only pipeline schedule: its ranks are
    laid out tp x pp x dp like the trainer's."""
    from pathlib import Path

    from rldsl.compiler.plan_view import render_plan

    text = (Path(__file__).parent.parent / "pipelines" / "hybrid_groups.rlp").read_text()
    engine = "engine = megatron(tp = 2, pp = 1"
    assert engine in text
    result = compile_source(text.replace(engine, "engine = megatron(tp = 2, pp = 2", 1))
    assert result.ok, [d.message for d in result.diagnostics]
    reference = result.plan.pipeline().stage("reference")
    assert (reference.tp, reference.pp, reference.dp) == (2, 2, 2)
    assert {r.pp_rank for r in reference.ranks} == {0, 1}
    shown = render_plan(result)
    assert "reference    logprob   megatron tp=2 pp=2 dp=2" in shown
    assert "pp groups: [2:0 2:4] [2:1 2:5] [2:2 2:6] [2:3 2:7]" in shown
