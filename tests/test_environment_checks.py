"""`check` and `plan` for multi-turn environments: the block, the fields, the plan, RLP601-RLP608."""

import sys
from pathlib import Path

from rldsl.compiler.driver import compile_file, compile_source
from rldsl.compiler.rules.environments import TINY_CONTEXT
from rldsl.plan import ExecutionPlan

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = (ROOT / "pipelines" / "multiturn_arith.rlp").read_text()


def _compile(text, base_dir=ROOT / "pipelines"):
    return compile_source(text, base_dir=base_dir)


def _codes(text, base_dir=ROOT / "pipelines"):
    return sorted(d.code for d in _compile(text, base_dir).diagnostics)


def test_the_example_plans_its_environment():
    result = _compile(PIPELINE)
    assert result.ok and not result.diagnostics, result.diagnostics
    plan = ExecutionPlan.from_json(result.plan.to_json())
    pipe = plan.pipeline()
    env = pipe.environment("retry")
    assert (env.fn, env.max_turns, env.max_tokens, env.timeout_s, env.processes) == \
        ("rldsl.environments:ArithRetry", 3, 36, 5.0, 2)
    assert pipe.stage("rollout").settings["environment"] == "retry"
    fields = {f for e in pipe.edges if e.src == "rollout" for f in e.fields}
    assert {"loss_mask", "episode_reward", "episode_status", "turns"} <= fields


def test_straggler_cuts_reach_the_plan_and_a_low_factor_is_a_warning():
    cut = PIPELINE.replace("  timeout = 5s\n", "  timeout = 5s\n  straggler = 8\n")
    result = _compile(cut)
    assert result.ok and not result.diagnostics, result.diagnostics
    assert ExecutionPlan.from_json(result.plan.to_json()).pipeline().environment("retry").straggler == 8.0
    assert _compile(PIPELINE).plan.pipeline().environment("retry").straggler == 0.0  # off unless asked for
    low = [d for d in _compile(cut.replace("straggler = 8", "straggler = 3")).diagnostics]
    assert [(d.code, d.severity) for d in low] == [("RLP608", "warning")] and "environment `retry`" in low[0].message
    reward = (ROOT / "pipelines" / "grpo_async.rlp").read_text().replace("timeout = 5s }", "timeout = 5s  straggler = 2 }")
    found = [d for d in _compile(reward).diagnostics if d.code == "RLP608"]
    assert len(found) == 1 and "reward stage `score`" in found[0].message
    assert _compile(reward).plan.pipeline().stage("score").settings["straggler"] == 2.0

def test_a_pipeline_without_environment_plans_none():
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text()
    pipe = _compile(text).plan.pipeline()
    assert pipe.environments == [] and "environment" not in pipe.stage("rollout").settings
    assert not {"loss_mask", "turns"} & {f for e in pipe.edges for f in e.fields}


def test_the_builtin_context_is_the_tiny_models():
    from rldsl.models.tiny import TinyLMConfig

    assert TINY_CONTEXT == TinyLMConfig(vocab_size=8).max_positions


def test_an_environment_on_another_stage_kind_says_where_it_belongs():
    text = PIPELINE.replace('stage reward score { fn = "rldsl.environments:episode_reward" }',
                            'stage reward score { fn = "rldsl.environments:episode_reward"  environment = retry }')
    found = [d for d in _compile(text).diagnostics if d.code == "RLP103"]
    assert len(found) == 1 and found[0].help == "`environment` is a key of generate stages"


def test_an_unknown_environment_name_is_reported_once():
    text = PIPELINE.replace("environment = retry", "environment = retri")
    assert _codes(text) == ["RLP101"]  # the episode fields' producer is unknown: no RLP204 on top


def test_episode_reward_without_an_environment_has_no_producer():
    text = PIPELINE.replace("  environment = retry\n", "")
    assert "RLP204" in _codes(text) and "RLP603" in _codes(text)


def test_max_model_len_bounds_the_conversation():
    text = PIPELINE.replace("engine = torch\n  gpus = 1\n  samples_per_prompt",
                            "engine = vllm(max_model_len = 32)\n  gpus = 1\n  samples_per_prompt")
    found = [d for d in _compile(text).diagnostics if d.code == "RLP601"]
    assert len(found) == 1 and "`max_model_len` of `rollout` (32 tokens)" in found[0].message
    assert "RLP601" not in _codes(text.replace("max_model_len = 32", "max_model_len = 4096"))


def test_a_prompt_budget_counts_in_the_context():
    text = PIPELINE.replace("eval_size = 128", "eval_size = 128  max_prompt_tokens = 30")
    found = [d for d in _compile(text).diagnostics if d.code == "RLP601"]
    assert len(found) == 1 and "30 (`max_prompt_tokens`) + 36" in found[0].message


def test_an_environment_module_beside_the_pipeline_is_found(tmp_path):
    path = tmp_path / "game.rlp"
    path.write_text(PIPELINE.replace("rldsl.environments:ArithRetry", "my_env_module_xyz:Game"))
    assert "RLP604" in {d.code for d in compile_file(path).diagnostics}
    (tmp_path / "my_env_module_xyz.py").write_text("class Game: pass\n")
    assert "RLP604" not in {d.code for d in compile_file(path).diagnostics}
    assert "my_env_module_xyz" not in sys.modules  # `check` runs no user code


def test_check_imports_no_torch():
    import subprocess

    code = ("import sys; from rldsl.compiler.driver import compile_file; "
            "compile_file('pipelines/multiturn_arith.rlp'); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_tools_reach_the_plan_and_a_missing_one_is_named():
    with_tools = PIPELINE.replace("  timeout = 5s\n", '  timeout = 5s\n  tools = ["rldsl.environments:calculate"]\n'
                                  "  tool_format = hermes\n  max_observation_tokens = 12\n")
    result = _compile(with_tools)
    assert result.ok and not result.diagnostics, result.diagnostics
    env = ExecutionPlan.from_json(result.plan.to_json()).pipeline().environment("retry")
    assert (env.tools, env.tool_format, env.max_observation_tokens) == (["rldsl.environments:calculate"], "hermes", 12)
    default = _compile(PIPELINE).plan.pipeline().environment("retry")
    assert (default.tool_format, default.max_observation_tokens) == (None, None)
    typo = [d for d in _compile(with_tools.replace(":calculate", ":calculat")).diagnostics if d.code == "RLP604"]
    assert len(typo) == 1 and "no tool `calculat` (did you mean `calculate`?)" in typo[0].message
    unread = _codes(with_tools.replace("  tool_format = hermes\n", ""))
    assert unread == ["RLP607"]
