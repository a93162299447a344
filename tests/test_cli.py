"""The command line: exit codes, formats, plan files, no heavy imports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rldsl.cli import main
from rldsl.plan import ExecutionPlan

ROOT = Path(__file__).resolve().parent.parent
GRPO = str(ROOT / "pipelines" / "grpo_async.rlp")
BAD = str(ROOT / "tests" / "golden" / "RLP304.rlp")
WARN = str(ROOT / "tests" / "golden" / "RLP306.rlp")


def test_check_clean_exits_0(capsys):
    assert main(["check", GRPO]) == 0
    assert "ok" in capsys.readouterr().out


def test_check_findings_exit_1_and_render_on_stderr(capsys):
    assert main(["check", "--color", "never", BAD]) == 1
    err = capsys.readouterr().err
    assert "error[RLP304]" in err and "-->" in err and "^" in err and "= help:" in err


def test_warnings_pass_unless_strict():
    assert main(["check", WARN]) == 0
    assert main(["check", "--strict", WARN]) == 1


def test_missing_file_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "does/not/exist.rlp"])
    assert exc.value.code == 2
    assert "no such file" in capsys.readouterr().err


def test_directory_and_binary_files_are_usage_errors(tmp_path):
    binary = tmp_path / "x.rlp"
    binary.write_bytes(b"\xff\xfe\x00bad")
    for path in (tmp_path, binary):
        with pytest.raises(SystemExit) as exc:
            main(["check", str(path)])
        assert exc.value.code == 2


def test_check_json_schema(capsys):
    assert main(["check", "--format", "json", BAD]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["schema_version"] == 1 and payload["valid"] is False
    diag = payload["diagnostics"][0]
    assert set(diag) >= {"code", "severity", "message", "help", "range"}
    assert diag["range"]["start"] == {"line": 23, "column": 21}


def test_check_sarif(capsys):
    assert main(["check", "--format", "sarif", BAD]) == 1
    sarif = json.loads(capsys.readouterr().out)
    assert sarif["version"] == "2.1.0"
    result = sarif["runs"][0]["results"][0]
    assert result["ruleId"] == "RLP304" and result["level"] == "error"
    assert sarif["runs"][0]["tool"]["driver"]["rules"][0]["id"] == "RLP304"


def test_plan_text_has_map_and_summary(capsys):
    assert main(["plan", GRPO]) == 0
    out = capsys.readouterr().out
    assert "GPU map:" in out and "gpu 0: rollout[0]" in out
    assert out.strip().splitlines()[-1].startswith("plan: ") and "2/2 GPUs" in out


def test_plan_out_round_trips(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", GRPO, "--out", str(out)]) == 0
    plan = ExecutionPlan.from_json(out.read_text())
    assert plan.to_json() == out.read_text().strip()
    assert plan.pipeline().batch.global_batch == plan.pipeline().batch.prompts_per_step * plan.pipeline().batch.samples_per_prompt


def test_plan_of_a_bad_file_exits_1(capsys):
    assert main(["plan", BAD]) == 1


@pytest.mark.parametrize("fmt,marker", [("mermaid", "flowchart LR"), ("dot", "digraph rldsl")])
def test_graph(fmt, marker, capsys):
    assert main(["graph", GRPO, "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert marker in out and "rollout" in out and "weights" in out


def test_explain(capsys):
    assert main(["explain", "RLP304"]) == 0
    assert "deadlock" in capsys.readouterr().out
    assert main(["explain", "501"]) == 0
    assert main(["explain", "307"]) == 0
    assert "retired" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["explain", "RLP999"])
    assert exc.value.code == 2


def test_run_with_a_broken_plan_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text('{"schema_version": 99}')
    with pytest.raises(SystemExit) as exc:
        main(["run", "--plan", str(bad)])
    assert exc.value.code == 2


def test_check_and_plan_import_no_heavy_modules():
    code = ("import sys; from rldsl.cli import main; main(['plan', %r]); "
            "heavy = [m for m in ('torch', 'ray', 'transfer_queue', 'vllm', 'megatron', 'rich') if m in sys.modules]; "
            "sys.exit(1 if heavy else 0)") % GRPO
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_python_dash_m_works():
    proc = subprocess.run([sys.executable, "-m", "rldsl", "check", GRPO], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_run_refuses_gpu_engines_on_a_cpu_machine_before_starting_anything(capsys, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["run", str(ROOT / "pipelines" / "gpu_cluster.rlp"), "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "rldsl[run,gpu]" in err


def test_run_names_a_misspelt_reward_function(capsys, tmp_path):
    pytest.importorskip("torch")
    bad = tmp_path / "bad.rlp"
    bad.write_text((ROOT / "pipelines" / "sim_async.rlp").read_text().replace("exact_match", "exact_mach"))
    assert main(["run", str(bad), "--run-dir", str(tmp_path / "run")]) == 2
    assert "did you mean 'exact_match'" in capsys.readouterr().err


def test_resume_of_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--resume", str(tmp_path)])
    assert exc.value.code == 2


def test_local_paths_in_the_plan_are_anchored_to_the_pipeline_file(tmp_path):
    from rldsl.compiler.driver import compile_file

    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text().replace(
        'source = "builtin:arith"', 'source = "jsonl:data/train.jsonl"')
    (tmp_path / "p.rlp").write_text(text)
    plan = compile_file(tmp_path / "p.rlp").plan
    assert plan.pipeline().datasets[0].source == f"jsonl:{(tmp_path / 'data' / 'train.jsonl').resolve()}"


def test_run_refuses_a_logprob_stage_on_a_gpu_another_pipeline_shares_before_anything_starts(tmp_path, capsys):
    """Pipelines take turns on shared GPUs through leases held by generator
    replicas and train steps; a logprob stage there would hold none. `check`
    refuses it (RLP513), so `run` stops at the check, exit 1; a hand-edited
    saved plan meets the same predicate in the launcher
    (tests/test_launch_rules.py)."""
    text = (ROOT / "pipelines" / "multi_pipeline_cpu.rlp").read_text()
    text = text.replace('stage reward score { fn = "rldsl.rewards:exact_match" }',
                        'stage reward score { fn = "rldsl.rewards:exact_match" }\n'
                        '  stage logprob reference { model = policy  frozen  engine = torch  colocate = actor }', 1)
    text = text.replace("flow prompts -> rollout -> score -> actor",
                        "flow prompts -> rollout -> score -> reference -> actor", 1)
    (tmp_path / "two.rlp").write_text(text)
    code = main(["run", str(tmp_path / "two.rlp"), "--address", "127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "error[RLP513]: logprob stage `arith/reference` is on GPU 1 of node 0, which another pipeline shares" in err
