"""One pre-flight: what `rldsl run` refuses before it starts, `check` refuses
with a code and a caret, by the same predicates (rldsl/launch_rules.py).
Each held-out category has its failing file here; then the launcher's dry
checks run on every plan `check` accepts (the shipped pipelines, the golden
and compatibility files that pass, generated files) and refuse none."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rldsl.compiler.driver import compile_file, compile_source
from rldsl.launch_rules import BUILTIN_CONTEXT, BUILTIN_PROMPT_TOKENS, plan_refusals

ROOT = Path(__file__).resolve().parent.parent
BASE = (ROOT / "tests" / "golden" / "base.rlp").read_text()
TWO_PIPELINES = (ROOT / "tests" / "golden" / "RLP513.rlp").read_text()
HF = 'model policy { source = "hf:/models/Qwen2.5-0.5B-Instruct"  params = 0.5B }'


def edit(text: str, *replacements: tuple[str, str]) -> str:
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def at(text: str, needle: str, nth: int = 1, context: str | None = None) -> tuple[int, int, int, int]:
    """The span of ``needle`` in the nth occurrence of ``context`` (default: the needle itself): where a
    caret must stand."""
    anchor = context or needle
    index = -1
    for _ in range(nth):
        index = text.index(anchor, index + 1)
    index += anchor.index(needle)
    line = text.count("\n", 0, index) + 1
    col = index - (text.rfind("\n", 0, index) + 1) + 1
    return line, col, line, col + len(needle)


def refused(text: str, code: str, needle: str, nth: int = 1, context: str | None = None):
    """The one error of ``text``: ``code``, its caret under ``needle`` (as ``at`` finds it)."""
    result = compile_source(text, "held_out.rlp")
    errors = [d for d in result.diagnostics if d.is_error]
    assert [d.code for d in errors] == [code], [(d.code, d.message) for d in result.diagnostics]
    assert tuple(errors[0].span) == at(text, needle, nth, context), (errors[0].span, at(text, needle, nth, context))
    assert result.plan is None
    return errors[0]


def with_generate(*lines: str) -> str:
    return edit(BASE, ("  samples_per_prompt = 4\n", "  samples_per_prompt = 4\n" + "".join(f"  {x}\n" for x in lines)))


# ------------------------------------------------------- held-out categories


def test_a_collective_transport_on_gpus_another_pipeline_shares():
    text = edit(TWO_PIPELINES, ('  stage logprob reference { model = policy  frozen  gpus = [2] }\n', ""),
                ("score -> reference -> actor", "score -> actor"), ("loss = grpo(kl = 0.001)", ""),
                ("stage sync weights { from = actor  to = rollout }",
                 "stage sync weights { from = actor  to = rollout  transport = collective }"))
    found = refused(text, "RLP511", "collective")
    assert "GPUs leased from another pipeline" in found.message and found.edit[1] == "auto"
    # alone on its GPUs the same pipeline streams rank to rank
    alone = text[:text.index("pipeline b")]
    assert compile_source(alone).ok


def test_a_logprob_stage_on_gpus_another_pipeline_shares():
    found = refused(TWO_PIPELINES, "RLP513", "[2]", 2)
    assert found.message.startswith("logprob stage `b/reference` is on GPU 2 of node 0, which another pipeline")
    # colocated with a trainer on a GPU pipeline `a` generates on: the caret is on the colocation
    on_shared = edit(TWO_PIPELINES, ("frozen  gpus = [2]", "frozen  colocate = actor"), ("gpus = [3]", "gpus = [1]"))
    refused(on_shared, "RLP513", "actor", context="frozen  colocate = actor")
    # with its own trainer on a GPU no other pipeline uses, it is accepted
    assert compile_source(edit(TWO_PIPELINES, ("frozen  gpus = [2]", "frozen  colocate = actor"))).ok


@pytest.mark.parametrize(("engine", "stage"), [("vllm", "rollout"), ("sglang", "rollout"), ("megatron", "actor")])
def test_a_checkpoint_engine_on_the_builtin_model(engine, stage):
    anchor = f"stage {'generate' if stage == 'rollout' else 'train'} {stage} {{\n  model = policy\n"
    text = edit(BASE, (anchor, anchor + f"  engine = {engine}\n"))
    found = refused(text, "RLP112", engine)
    assert f"engine `{engine}` loads a local Hugging Face checkpoint" in found.message
    assert not compile_source(edit(text, ('model policy { source = "builtin:tiny-lm" }', HF))).diagnostics


def test_a_vllm_logprob_stage_on_the_builtin_model():
    text = edit(BASE, ("stage reward score", "stage logprob reference { model = policy  frozen  engine = vllm  "
                                             "colocate = actor }\n"
                                             "stage reward score"), ("score -> actor", "score -> reference -> actor"))
    refused(text, "RLP112", "vllm")


def test_a_chat_template_on_the_builtin_model():
    text = edit(BASE, ('source = "builtin:tiny-lm" }', 'source = "builtin:tiny-lm"  chat_template = true }'))
    refused(text, "RLP112", "true")


def test_an_environment_on_the_sim_engine():
    text = edit(with_generate("engine = sim", "max_new_tokens = 8", "environment = retry"),
                ('stage reward score { fn = "rldsl.rewards:exact_match" }',
                 'environment retry { fn = "rldsl.environments:ArithRetry"  max_turns = 2  max_tokens = 20 }\n'
                 'stage reward score { fn = "rldsl.environments:episode_reward" }'),
                ('source = "builtin:arith"', 'source = "builtin:arith"  eval_metric = "rldsl.rewards:exact_match"'))
    refused(text, "RLP116", "retry")


def test_an_evaluation_on_sim_generators():
    text = edit(with_generate("engine = sim"),
                ('source = "builtin:arith"', 'source = "builtin:arith"  eval_on = generators'))
    found = refused(text, "RLP116", "generators")
    assert found.edit[1] == "evaluator"
    # no evaluation runs (a sim trainer has no weights; or none asked for): nothing to refuse
    quiet = edit(text, ("  gpus = 2\n  prompts_per_step", "  engine = sim\n  gpus = 2\n  prompts_per_step"))
    assert not compile_source(quiet).diagnostics
    assert not compile_source(edit(text, ("eval_on = generators", "eval_on = generators  eval_size = 0"))).diagnostics


def test_a_temperature_vllm_refuses():
    anchor = "stage generate rollout {\n  model = policy\n"
    text = edit(BASE, (anchor, anchor + "  engine = vllm\n  temperature = 2.5\n"),
                ('model policy { source = "builtin:tiny-lm" }', HF))
    found = refused(text, "RLP106", "2.5", context="temperature = 2.5")
    assert "vLLM samples at temperatures up to 2" in found.message
    assert not compile_source(edit(text, ("temperature = 2.5", "temperature = 2.0"))).diagnostics


def test_top_p_zero():
    found = refused(with_generate("top_p = 0"), "RLP106", "0", context="top_p = 0")
    assert "top_p = 0 keeps no token" in found.message


@pytest.mark.parametrize("clip", ["1", "100%", "1.5"])
def test_a_clip_of_one_or_more(clip):
    text = edit(BASE, ("  prompts_per_step = 8\n", f"  prompts_per_step = 8\n  loss = grpo(clip = {clip})\n"))
    if clip == "1.5":  # not a fraction at all: the type's own finding
        assert [d.code for d in compile_source(text).diagnostics] == ["RLP106"]
        return
    assert refused(text, "RLP312", f"clip = {clip}").edit[1] == "clip = 0.2"


def cut(text: str, tokens: str) -> int:
    """The one finding of ``text``: warning RLP117 under ``max_new_tokens = tokens``; the plan's cut value,
    which is also the finding's edit."""
    result = compile_source(text, "held_out.rlp")
    (found,) = result.diagnostics
    assert (found.code, found.severity) == ("RLP117", "warning")
    assert tuple(found.span) == at(text, tokens, context=f"max_new_tokens = {tokens}")
    planned = result.plan.pipeline().stage("rollout").settings["max_new_tokens"]
    assert found.edit[1] == str(planned)
    return planned


@pytest.mark.parametrize("tokens", [58, 64, 200])
def test_responses_past_the_builtin_models_context_are_cut_to_fit_with_a_warning(tokens, tmp_path):
    """A response that reached the context would stop the run; one within it runs as before, so the plan
    cuts `max_new_tokens` to what fits and `check --strict` fails the file."""
    text = with_generate(f"max_new_tokens = {tokens}")
    assert cut(text, str(tokens)) == 57  # 64 positions - the 7 of `99+99=` with BOS
    assert not compile_source(with_generate("max_new_tokens = 57")).diagnostics
    (tmp_path / "p.rlp").write_text(text)
    from rldsl.cli import main

    assert main(["check", str(tmp_path / "p.rlp")]) == 0 and main(["check", "--strict", str(tmp_path / "p.rlp")]) == 1


def test_the_context_counts_the_longest_prompt_of_each_source():
    reverse = edit(with_generate("max_new_tokens = 50"), ('"builtin:arith"', '"builtin:reverse"'))
    assert cut(reverse, "50") == 49
    bounded = edit(with_generate("max_new_tokens = 60"),
                   ('source = "builtin:arith"', 'source = "jsonl:data/train.jsonl"  max_prompt_tokens = 4'))
    assert not compile_source(bounded).diagnostics  # 4 + 60 fit
    assert cut(edit(bounded, ("max_new_tokens = 60", "max_new_tokens = 61")), "61") == 60


def test_prompts_that_fill_the_context_leave_no_room():
    text = edit(BASE, ('source = "builtin:arith"', 'source = "jsonl:data/train.jsonl"  max_prompt_tokens = 64'))
    refused(text, "RLP106", "64", context="max_prompt_tokens = 64")


def test_a_default_response_length_is_cut_to_the_context_in_the_plan():
    plan = compile_source(BASE).plan.pipeline()
    assert plan.stage("rollout").settings["max_new_tokens"] == BUILTIN_CONTEXT - BUILTIN_PROMPT_TOKENS["builtin:arith"]
    hf = compile_source(edit(BASE, ('model policy { source = "builtin:tiny-lm" }', HF))).plan.pipeline()
    assert hf.stage("rollout").settings["max_new_tokens"] == 64  # the language's default where no limit is known


def test_the_builtin_prompt_lengths_and_context_are_the_models():
    pytest.importorskip("torch")
    from rldsl.models import CharTokenizer
    from rldsl.models.tiny import TinyLMConfig
    from rldsl.tasks import load_dataset

    assert BUILTIN_CONTEXT == TinyLMConfig(vocab_size=8).max_positions
    tokenizer = CharTokenizer()
    for source, longest in BUILTIN_PROMPT_TOKENS.items():
        lengths = {len(tokenizer.encode(p.text, add_bos=True)) for split in ("train", "eval")
                   for p in load_dataset(source, split)}
        assert max(lengths) == longest, source


# ------------------------------------------------------- the launcher agrees


def test_the_launcher_refuses_a_hand_edited_plan_by_the_same_predicates():
    """A saved plan is JSON anyone can edit: `run --plan` re-checks it (plan_check) and the launcher's dry
    checks refuse it, naming the rule `check` gives the file."""
    pytest.importorskip("ray")
    from rldsl.compiler.plan_check import check_plan
    from rldsl.runtime.ray_lowering.launch import PreflightError, dry_checks

    plan = compile_source(BASE).plan
    pipe = plan.pipeline()
    edits = {
        "RLP112": dataclasses.replace(pipe, stages=[dataclasses.replace(s, engine=dataclasses.replace(s.engine,
                                      name="vllm")) if s.name == "rollout" else s for s in pipe.stages]),
        "RLP106": dataclasses.replace(pipe, stages=[dataclasses.replace(s, settings={**s.settings, "top_p": 0.0})
                                                    if s.name == "rollout" else s for s in pipe.stages]),
        "RLP117": dataclasses.replace(pipe, stages=[dataclasses.replace(s, settings={**s.settings,
                                                                                     "max_new_tokens": 60})
                                                    if s.name == "rollout" else s for s in pipe.stages]),
        "RLP312": dataclasses.replace(pipe, stages=[dataclasses.replace(s, settings={
            **s.settings, "loss": {**s.settings["loss"], "clip": 1.0}}) if s.name == "actor" else s
            for s in pipe.stages]),
    }
    for code, edited in edits.items():
        bad = dataclasses.replace(plan, pipelines=[edited])
        assert [r.code for r in plan_refusals(bad)] == [code]
        assert code in {f.code for f in check_plan(bad)}
        with pytest.raises(PreflightError, match=code):
            dry_checks(bad)


def test_the_launcher_refuses_a_logprob_stage_moved_onto_a_shared_gpu():
    pytest.importorskip("ray")
    from rldsl.runtime.ray_lowering.launch import PreflightError, dry_checks

    plan = compile_source(edit(TWO_PIPELINES, ("frozen  gpus = [2]", "frozen  colocate = actor"))).plan
    b = plan.pipeline("b")
    moved = [dataclasses.replace(s, ranks=[dataclasses.replace(r, gpus=[2]) for r in s.ranks])
             if s.name == "reference" else s for s in b.stages]
    bad = dataclasses.replace(plan, pipelines=[plan.pipeline("a"), dataclasses.replace(b, stages=moved)])
    with pytest.raises(PreflightError, match="logprob stage `reference` is on GPU 2 of node 0.*RLP513"):
        dry_checks(bad)


def accepted_plans():
    """Every file `check` accepts that the project keeps: pipelines, golden and root-cause examples that
    pass, the compatibility corpus."""
    paths = sorted((ROOT / "pipelines").glob("*.rlp")) + sorted((ROOT / "tests" / "golden").glob("*.rlp")) + \
        sorted((ROOT / "tests" / "root_causes").glob("*.rlp")) + sorted((ROOT / "tests" / "compat").glob("*.rlp"))
    for path in paths:
        result = compile_file(path)
        if result.ok:
            yield pytest.param(result.plan, id=path.relative_to(ROOT).as_posix())


@pytest.mark.parametrize("plan", list(accepted_plans()))
def test_the_launchers_dry_checks_refuse_no_plan_check_accepts(plan):
    pytest.importorskip("ray")
    from rldsl.runtime.ray_lowering.launch import dry_checks

    assert not plan_refusals(plan)
    dry_checks(plan)  # raises PreflightError on a refusal


# --------------------------------------------------------- generated files


ENGINES = {"generate": ["torch", "sim", "vllm", "sglang"], "logprob": ["torch", "sim", "vllm", "megatron", "fsdp"],
           "train": ["torch", "sim", "megatron", "fsdp"]}


@st.composite
def pipelines(draw) -> str:
    """A pipeline near the valid ones, whose settings vary over what the launcher refuses."""
    hf = draw(st.booleans())
    source = '"hf:/models/Qwen2.5-0.5B-Instruct"  params = 0.5B' if hf else '"builtin:tiny-lm"'
    chat = "  chat_template = true" if draw(st.booleans()) and draw(st.booleans()) else ""
    dataset = draw(st.sampled_from(['"builtin:arith"', '"builtin:reverse"', '"jsonl:data/train.jsonl"']))
    dataset += draw(st.sampled_from(["", "  max_prompt_tokens = 8", "  eval_on = generators", "  eval_size = 0"]))
    gen = [f"engine = {draw(st.sampled_from(ENGINES['generate']))}", "gpus = 1",
           f"samples_per_prompt = {draw(st.integers(1, 4))}"]
    gen += draw(st.lists(st.sampled_from(["temperature = 0", "temperature = 2.5", "top_p = 0", "top_p = 0.5", "max_new_tokens = 8",
                                          f"max_new_tokens = {draw(st.integers(1, 80))}"]), max_size=2, unique=True))
    logprob = draw(st.sampled_from([None, "frozen", "policy", "batch_start"]))
    train = [f"engine = {draw(st.sampled_from(ENGINES['train']))}", "gpus = 1", "prompts_per_step = 4"]
    train += draw(st.lists(st.sampled_from(["lr = 0", "loss = grpo(correction = tis)", "loss = grpo(clip = 1)"]),
                           max_size=1))
    transport = draw(st.sampled_from(["auto", "collective", "object_store"]))
    lines = ["pipeline p", "cluster { nodes = 1  gpus_per_node = 4 }", f"model policy {{ source = {source}{chat} }}",
             f"dataset prompts {{ source = {dataset} }}",
             "stage generate rollout { model = policy  " + "  ".join(gen) + " }",
             'stage reward score { fn = "rldsl.rewards:exact_match" }',
             "stage train actor { model = policy  " + "  ".join(train) + " }"]
    receivers, chain = ["rollout"], "prompts -> rollout -> score"
    if logprob:
        engine = draw(st.sampled_from(ENGINES["logprob"]))
        kind = {"frozen": "frozen", "policy": "", "batch_start": "recompute = batch_start"}[logprob]
        lines.append(f"stage logprob scorer {{ model = policy  engine = {engine}  {kind}  colocate = actor }}")
        chain += " -> scorer"
        receivers += [] if logprob == "frozen" else ["scorer"]
    lines += [f"stage sync weights {{ from = actor  to = [{', '.join(receivers)}]  transport = {transport} }}",
              f"flow {chain} -> actor", f"staleness {{ max_lag = {draw(st.integers(0, 1))} }}"]
    return "\n".join(lines) + "\n"


@st.composite
def shared_pipelines(draw) -> str:
    """Two pipelines taking turns on GPUs, with a logprob stage and a transport that vary."""
    where = draw(st.sampled_from(["gpus = [2]", "gpus = [3]", "colocate = actor"]))
    transport = draw(st.sampled_from(["auto", "collective"]))
    actor_b = draw(st.sampled_from(["[3]", "[1]"]))
    text = edit(TWO_PIPELINES, ("frozen  gpus = [2]", f"frozen  {where}"), ("gpus = [3]", f"gpus = {actor_b}"))
    return edit(text, ("stage sync weights { from = actor  to = rollout }\n  flow prompts -> rollout -> score -> actor",
                       f"stage sync weights {{ from = actor  to = rollout  transport = {transport} }}\n"
                       "  flow prompts -> rollout -> score -> actor"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(pipelines(), shared_pipelines()))
def test_generated_files_that_check_accepts_the_launcher_accepts(text):
    pytest.importorskip("ray")
    from rldsl.runtime.ray_lowering.launch import dry_checks

    result = compile_source(text, "generated.rlp")
    if not result.ok:
        return
    assert not plan_refusals(result.plan), text
    dry_checks(result.plan)


def test_the_generators_reach_both_sides():
    """The property above is not vacuous: generated files both pass and fail `check`, the new rules among
    the failures."""
    from hypothesis import find

    # examples compiled on a loaded machine may take 0.3 s each; `find`'s own budget of examples stays
    untimed = settings(deadline=None, max_examples=2000)
    find(pipelines(), lambda text: compile_source(text).ok, settings=untimed)
    for code in ("RLP106", "RLP112", "RLP116", "RLP117", "RLP312", "RLP511"):
        find(pipelines(), lambda text, code=code: code in {d.code for d in compile_source(text).diagnostics},
             settings=untimed)
    find(shared_pipelines(), lambda text: "RLP513" in {d.code for d in compile_source(text).diagnostics},
         settings=untimed)
    find(shared_pipelines(), lambda text: compile_source(text).ok, settings=untimed)
