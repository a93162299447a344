"""`--set TARGET.KEY=VALUE`: an override is written into the source and
checked like the file; `plan` shows it; a run keeps it in its plan.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.runs import rldsl, rldsl_here
from tests.shared_runs import SIM_OVERRIDES

from rldsl.compiler.driver import compile_source
from rldsl.compiler.overrides import OverrideError, apply_overrides

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = (ROOT / "pipelines" / "grpo_async.rlp").read_text()
MULTI = (ROOT / "pipelines" / "multi_pipeline_cpu.rlp").read_text()


def plan_of(text: str):
    result = compile_source(text, "x.rlp")
    assert result.ok, result.diagnostics
    return result.plan


def test_a_key_is_replaced_added_or_its_block_created_and_lines_stay_put():
    text = apply_overrides(DEFAULT, ["actor.lr=1e-5", "rollout.top_p=0.9", "buffer.capacity=64",
                                     "reference.frozen=true"])
    assert len(text.splitlines()) == len(DEFAULT.splitlines()) + 1  # only the new `buffer` block, at the end
    pipe = plan_of(text).pipelines[0]
    assert pipe.stage("actor").settings["lr"] == 1e-5 and pipe.stage("rollout").settings["top_p"] == 0.9
    assert pipe.batch.buffer_capacity == 64


def test_a_later_override_wins_and_run_length_is_settable():
    assert plan_of(apply_overrides(DEFAULT, ["run.steps=7", "run.steps=3"])).pipelines[0].run.steps == 3


def test_a_wrong_value_is_the_finding_it_would_be_in_the_file_at_the_files_line():
    result = compile_source(apply_overrides(DEFAULT, ["actor.lr=-1"]), "grpo_async.rlp")
    (finding,) = result.diagnostics
    line = next(i for i, text in enumerate(DEFAULT.splitlines(), 1) if text.strip().startswith("lr ="))
    assert finding.code == "RLP106" and finding.span.line == line


@pytest.mark.parametrize(("override", "says"), [
    ("actr.lr=1", "no stage, model or dataset named `actr` (did you mean `actor`?)"),
    ("actor.lr", "write TARGET.KEY=VALUE"),
    ("lr=1", "write TARGET.KEY=VALUE"),
    ("nope.actor.lr=1", "no pipeline `nope`"),
])
def test_overrides_that_name_nothing_are_refused(override, says):
    with pytest.raises(OverrideError, match=re.escape(says)):
        apply_overrides(DEFAULT, [override])


def test_several_pipelines_need_the_pipeline_named():
    with pytest.raises(OverrideError, match="several pipelines"):
        apply_overrides(MULTI, ["actor.lr=1e-4"])
    name = plan_of(MULTI).pipelines[1].name
    plan = plan_of(apply_overrides(MULTI, [f"{name}.actor.lr=1e-4"]))
    assert plan.pipeline(name).stage("actor").settings["lr"] == 1e-4
    assert plan.pipelines[0].stage("actor").settings["lr"] != 1e-4



def test_a_value_cannot_add_a_stage_or_close_a_block():
    """VALUE is one value of the key's type, never text spliced into the file."""
    stages = {s.name for s in plan_of(DEFAULT).pipelines[0].stages}
    for override in ['actor.lr=1 } stage reward extra { fn = "rldsl.rewards:exact_match" }',
                     "actor.lr=1 }\nstage reward extra {", "actor.lr=1, 2", "run.steps=3 } run { steps = 4",
                     'actr } stage reward extra { fn = "x" } actor.lr=1',
                     'actor.lr } stage reward extra { fn = "x=1']:
        with pytest.raises(OverrideError):
            apply_overrides(DEFAULT, [override])
    # a string key takes the whole text as its string: the braces are characters of it
    text = apply_overrides(DEFAULT, ['cluster.gpu=H100 } stage reward extra { fn = "x" }'])
    assert {s.name for s in plan_of(text).pipelines[0].stages} == stages
    assert plan_of(text).cluster.gpu_type == 'H100 } stage reward extra { fn = "x" }'


@pytest.mark.parametrize(("override", "written"), [
    ("prompts.source=jsonl:data/x.jsonl", 'source = "jsonl:data/x.jsonl"'),  # a string key: quoted for it
    ('prompts.source="builtin:reverse"', 'source = "builtin:reverse"'),
    ("score.fn=rldsl.rewards:char_match", 'fn = "rldsl.rewards:char_match"'),
    ("rollout.engine=vllm( tp=2 ,)", "engine = vllm(tp = 2)"),  # written out from its parse
    ("rollout.gpus=[0 , 1..2]", "gpus = [0, 1..2]"),
    ("actor.lr=3e-5   # a comment", "lr = 3e-5"),
    ("staleness.order=in_order", "order = in_order"),
])
def test_a_value_is_parsed_as_the_keys_type_and_written_from_its_parse(override, written):
    text = apply_overrides(DEFAULT, [override])
    assert written in text and written not in DEFAULT
    assert len(text.splitlines()) == len(DEFAULT.splitlines())  # on its key's line, every line where it was
    assert compile_source(text).program is not None


def test_a_number_past_the_range_is_its_finding_at_the_files_line():
    result = compile_source(apply_overrides(DEFAULT, ["actor.lr=1e30"]), "grpo_async.rlp")
    (finding,) = result.diagnostics
    line = next(i for i, text in enumerate(DEFAULT.splitlines(), 1) if text.strip().startswith("lr ="))
    assert finding.code == "RLP106" and "too large" in finding.message and finding.span.line == line


def test_plan_shows_and_saves_the_overrides(tmp_path):
    out = tmp_path / "plan.json"
    shown = rldsl("plan", "pipelines/grpo_async.rlp", "--set", "actor.lr=1e-5", "--out", str(out))
    assert shown.returncode == 0 and "overrides (--set):\n  actor.lr=1e-5" in shown.stdout
    saved = json.loads(out.read_text())
    assert saved["overrides"] == ["actor.lr=1e-5"]
    assert next(s for s in saved["pipelines"][0]["stages"] if s["name"] == "actor")["settings"]["lr"] == 1e-5


def test_check_says_the_findings_came_with_the_overrides():
    result = rldsl("check", "pipelines/grpo_async.rlp", "--set", "actor.lr=-1")
    assert result.returncode == 1 and "RLP106" in result.stderr
    assert "note: checked with --set actor.lr=-1 written into the file" in result.stderr
    bad = rldsl("check", "pipelines/grpo_async.rlp", "--set", "actr.lr=1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "(did you mean `actor`?)" in bad.stderr.split("\n")[0]


def test_a_saved_plan_takes_no_overrides(tmp_path):
    result = rldsl("run", "--plan", str(tmp_path / "plan.json"), "--set", "run.steps=2")
    assert result.returncode == 2 and "--set changes a pipeline file" in result.stderr


@pytest.mark.ray
def test_a_run_keeps_its_overrides_and_a_resume_reuses_them(sim_run_with_overrides):
    run_dir = sim_run_with_overrides.run_dir
    assert "run.steps=5" in SIM_OVERRIDES and sim_run_with_overrides.summary["steps"] == 5
    assert json.loads((run_dir / "plan.json").read_text())["overrides"] == SIM_OVERRIDES
    resumed = rldsl_here("run", "--resume", str(run_dir))  # its newest checkpoint holds every step: nothing starts
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "nothing to do: 5 of 5 steps are done" in resumed.stderr  # the resumed run kept steps = 5
    assert "starting Ray" not in resumed.stderr  # decided from run.json and the checkpoint alone
