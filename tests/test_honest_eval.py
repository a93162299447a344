"""Evaluation that is really held out, scored with the pipeline's own reward
(or a named metric), and reward modules found beside the pipeline file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.runtime.control.prompts import load_source
from rldsl.runtime.ray_lowering.evaluation import EvalMetric, score
from rldsl.runtime.protocols import Prompt

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = (ROOT / "pipelines" / "grpo_async.rlp").read_text()
ROWS = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a in range(30) for b in range(30)]


def compiled(tmp_path: Path, dataset: str, reward: str = "rldsl.rewards:exact_match"):
    text = DEFAULT.replace('"rldsl.rewards:exact_match"', f'"{reward}"') \
        .replace('dataset prompts { source = "builtin:arith"  eval_size = 128 }', dataset)
    result = compile_source(text, str(tmp_path / "p.rlp"), base_dir=tmp_path)
    assert result.ok, result.diagnostics
    return result, result.plan.pipeline()


def write_rows(path: Path) -> None:
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))


def test_a_jsonl_file_without_split_holds_its_eval_rows_out_of_training(tmp_path):
    write_rows(tmp_path / "mul.jsonl")
    _, pipe = compiled(tmp_path, 'dataset prompts { source = "jsonl:mul.jsonl" }')
    train, held_out = (load_source(pipe, pipe.datasets[0].source, split, 0) for split in ("train", "eval"))
    assert {p.text for p in train}.isdisjoint(p.text for p in held_out)
    assert len(train) + len(held_out) == len(ROWS) and 0.02 < len(held_out) / len(ROWS) < 0.09


def test_a_separate_eval_file_leaves_the_training_file_whole(tmp_path):
    write_rows(tmp_path / "mul.jsonl")
    (tmp_path / "heldout.jsonl").write_text('{"prompt": "7*7=", "answer": "49"}\n')
    _, pipe = compiled(tmp_path, 'dataset prompts { source = "jsonl:mul.jsonl"  eval_source = "jsonl:heldout.jsonl" }')
    assert len(load_source(pipe, pipe.datasets[0].source, "train", 0)) == len(ROWS)


def test_plan_says_where_the_evaluation_prompts_come_from(tmp_path):
    from rldsl.compiler.plan_view import render_plan

    write_rows(tmp_path / "mul.jsonl")
    result, _ = compiled(tmp_path, 'dataset prompts { source = "jsonl:mul.jsonl"  eval_size = 16 }')
    assert "evaluation: 16 prompts held out of jsonl:" in render_plan(result)
    assert "which training never reads" in render_plan(result)


def test_an_eval_source_that_is_the_training_file_is_a_finding(tmp_path):
    write_rows(tmp_path / "mul.jsonl")
    text = DEFAULT.replace('dataset prompts { source = "builtin:arith"  eval_size = 128 }',
                           'dataset prompts { source = "jsonl:mul.jsonl"  eval_source = "jsonl:mul.jsonl" }')
    assert [d.code for d in compile_source(text, "p.rlp", base_dir=tmp_path).diagnostics] == ["RLP313"]


REWARDS = '''
def partial(response, answer, prompt=""):
    return 0.5 if response.strip() else 0.0

def broken(response, answer, prompt=""):
    raise ValueError("no")
'''


def test_evaluation_scores_with_the_pipelines_reward_found_beside_the_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    _, pipe = compiled(tmp_path, 'dataset prompts { source = "builtin:arith"  eval_size = 8 }',
                       reward="my_rewards:partial")
    assert pipe.stage("score").settings["fn"] == f"my_rewards:partial@{tmp_path.resolve()}"
    monkeypatch.chdir("/")  # found through the plan, whatever the working directory
    metric = EvalMetric(pipe)
    prompts = [Prompt(0, "1+1=", "2"), Prompt(1, "2+2=", "4")]
    assert score([["2"], [""]], prompts, metric) == {"accuracy": 0.25, "pass_at_k": 0.0}
    assert metric.name == "reward"


def test_a_named_metric_and_one_that_fails(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    _, pipe = compiled(tmp_path, 'dataset prompts { source = "builtin:arith"  eval_metric = "my_rewards:broken" }')
    metric = EvalMetric(pipe)
    assert metric.name == "my_rewards:broken"
    result = score([["2", "3"]], [Prompt(0, "1+1=", "2")], metric)
    assert result == {"accuracy": 0.0, "pass_at_k": 0.0, "failed": 2}
    _, exact = compiled(tmp_path, 'dataset prompts { source = "builtin:arith"  eval_metric = '
                                  '"rldsl.rewards:exact_match" }', reward="my_rewards:partial")
    assert score([["2", "3"]], [Prompt(0, "1+1=", "2")], EvalMetric(exact)) == {"accuracy": 0.5, "pass_at_k": 1.0}


def test_an_evaluation_reward_that_hangs_is_killed_at_its_timeout_and_spins_nowhere(tmp_path):
    """The metric runs in reward processes: the hung response's process is
    killed and replaced at the timeout; no thread of this process spins on."""
    import threading
    import time

    import psutil

    _, pipe = compiled(tmp_path, 'dataset prompts { source = "builtin:arith"  eval_metric = '
                                 '"tests.reward_fns:hang_on_hang" }')
    pipe.stage("score").settings["timeout"] = 1.0
    metric = EvalMetric(pipe)
    try:
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        threads = threading.active_count()
        started = time.monotonic()
        result = score([["2", "hang", "3"]], [Prompt(0, "1+1=", "2")], metric)
        assert time.monotonic() - started < 5  # the timeout (1 s), not the hang (60 s)
        assert result == {"accuracy": 1 / 3, "pass_at_k": 1.0, "failed": 1}
        time.sleep(0.5)
        spinning = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
                    and p.cpu_percent(interval=0.2) > 50]
        assert not spinning and threading.active_count() <= threads
    finally:
        metric.close()


@pytest.mark.parametrize("metric", ['"nope"', '"a b:c"'])
def test_a_malformed_metric_is_a_finding(tmp_path, metric):
    text = DEFAULT.replace('eval_size = 128', f'eval_size = 128  eval_metric = {metric}')
    assert "RLP104" in [d.code for d in compile_source(text, "p.rlp").diagnostics]


def test_a_reward_module_beside_the_pipeline_runs_from_any_directory(tmp_path):
    """`rldsl run --dry-run` is not enough (it starts no reward): the preflight
    imports the reward from the plan, here from another working directory."""
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "p.rlp").write_text(DEFAULT.replace('"rldsl.rewards:exact_match"', '"my_rewards:partial"'))
    code = ("from rldsl.compiler.driver import compile_file; from rldsl.rewards import load_reward; "
            f"plan = compile_file({str(tmp_path / 'p.rlp')!r}).plan; "
            "print(load_reward(plan.pipeline().stage('score').settings['fn'])('x', 'y'))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env)
    assert result.stdout.strip() == "0.5", result.stderr
