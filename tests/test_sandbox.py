"""The code sandbox (rldsl.rewards.sandbox) and the `code_tests` reward, on a
small code task (tests/data/code_tasks.jsonl): right code scores 1, wrong
code 0, and a hang, a memory bomb, a connect and a fork bomb are stopped."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rldsl.rewards import code_tests, load_reward
from rldsl.rewards.code import extract_code
from rldsl.rewards.sandbox import network_isolation, run_python, sandbox_interpreter
from rldsl.tasks import load_dataset

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's limits are Linux's")

TASKS = Path(__file__).parent / "data" / "code_tasks.jsonl"
SOLUTIONS = [  # one right answer per task, in the form a model writes
    "Here is my solution:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "```python\ndef is_even(n):\n    return n % 2 == 0\n```",
    "```\nprint(input()[::-1])\n```",
]


@pytest.fixture(scope="module")
def tasks():
    return load_dataset(f"jsonl:{TASKS}", "train")


def test_right_code_scores_one_and_wrong_code_zero(tasks):
    assert [code_tests(solution, task.answer, task.text) for solution, task in zip(SOLUTIONS, tasks)] == [1, 1, 1]
    assert code_tests("```python\nprint(7)\n```", tasks[0].answer) == 0.0
    assert code_tests("```python\ndef is_even(n):\n    return n == 2\n```", tasks[1].answer) == 0.75
    assert code_tests("no code at all (", tasks[2].answer) == 0.0  # a syntax error is a failed test
    assert load_reward("rldsl.rewards:code_tests") is code_tests


def test_the_last_python_block_is_the_code():
    text = "```text\nnot code\n```\nfirst\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("print(1)") == "print(1)"


def test_an_infinite_loop_times_out_cleanly(tasks):
    started = time.monotonic()
    result = run_python("while True:\n    pass", timeout=1.0)
    assert result.timed_out and result.exit_code is None and not result.ok
    assert time.monotonic() - started < 3
    assert code_tests("```python\nwhile True: pass\n```", tasks[0].answer, timeout=0.5) == 0.0


def test_a_memory_bomb_is_stopped():
    result = run_python("x = bytearray(4 * 2**30)\nprint('allocated')", memory=256 * 2**20)
    assert result.memory_exceeded and result.exit_code == 1 and "allocated" not in result.stdout
    assert not run_python("x = bytearray(2**20)").memory_exceeded


def test_output_is_capped():
    result = run_python("print('x' * 2**20)", output=64 * 2**10)
    assert len(result.stdout) <= 64 * 2**10 and not result.ok


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


def test_a_socket_connect_fails(listener):
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {listener}), timeout=1)\nprint('connected')"
    result = run_python(code)
    assert result.exit_code != 0 and "connected" not in result.stdout
    assert "network access is disabled" in result.stderr


@pytest.mark.skipif(network_isolation() == "audit_hook", reason="no network namespace on this machine")
def test_a_program_started_by_the_code_has_no_network_either(listener):
    """A fresh interpreter has no audit hook: only the namespace stops it."""
    inner = f"import socket; socket.create_connection(('127.0.0.1', {listener}), timeout=1); print('connected')"
    code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-I', '-c', {inner!r}])"
    result = run_python(code, timeout=4)
    assert "connected" not in result.stdout
    assert "Network is unreachable" in result.stderr or "Errno" in result.stderr


def test_a_fork_bomb_is_stopped():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    started = time.monotonic()
    result = run_python(code, timeout=1.5, processes=8)
    assert result.timed_out and time.monotonic() - started < 4
    if os.geteuid() == 0 and sandbox_interpreter() is not None:  # each sandbox runs as a user id of its own
        deadline = time.monotonic() + 2  # killed; init may take a moment to reap them
        while _sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _sandbox_processes()


def _sandbox_processes() -> list[str]:
    """Processes of the sandbox user ids, but zombies (dead, waiting for init to reap them)."""
    rows = subprocess.run(["ps", "-eo", "uid=,stat="], capture_output=True, text=True).stdout.splitlines()
    return [row for row in rows if int(row.split()[0]) >= 3_000_000 and not row.split()[1].startswith("Z")]


def test_a_fork_bomb_meets_the_process_limit():
    result = run_python("import os\nfor _ in range(100):\n    os.fork() or os._exit(0)\nprint('forked')",
                        processes=4, timeout=3)
    assert "forked" not in result.stdout and ("Resource temporarily unavailable" in result.stderr
                                              or "BlockingIOError" in result.stderr)


def test_a_clean_environment_in_a_fresh_directory():
    os.environ["RLDSL_SECRET_FOR_TEST"] = "leak"
    try:
        result = run_python("import os, sys\nprint(sorted(os.environ))\nprint(os.listdir('.'))\nprint(input())",
                            stdin="given")
    finally:
        del os.environ["RLDSL_SECRET_FOR_TEST"]
    environment, files, given = result.stdout.splitlines()
    assert "RLDSL_SECRET_FOR_TEST" not in environment and files == "['main.py']" and given == "given"
