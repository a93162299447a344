"""check only ever returns diagnostics: random and mutated text never raise."""

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rldsl.compiler.diagnostics import Diagnostic, render_text, to_json
from rldsl.compiler.driver import compile_source

ROOT = Path(__file__).resolve().parent.parent
SEEDS = [p.read_text() for p in sorted((ROOT / "pipelines").glob("*.rlp"))] + \
        [p.read_text() for p in sorted((ROOT / "tests" / "golden").glob("*.rlp"))]
TOKENS = ["pipeline", "stage", "flow", "->", "{", "}", "[", "]", "(", ")", "=", ",", "..", "generate", "train",
          "reward", "logprob", "sync", "model", "dataset", "cluster", "policy", "actor", "rollout", "gpus", "0",
          "1", "8", "2..3", "256MiB", "30s", "50%", "7B", '"builtin:tiny-lm"', "true", "frozen", "vllm(tp = 2)",
          "megatron(tp = 2, pp = 2)", "max_lag", "\n", " ", "#", "colocate", "placement", "groups", "ratios"]


def _assert_only_diagnostics(text: str) -> None:
    result = compile_source(text, "fuzz.rlp")
    assert all(isinstance(d, Diagnostic) for d in result.diagnostics)
    render_text(result.diagnostics, text, "fuzz.rlp")
    to_json(result.diagnostics, "fuzz.rlp")
    if result.ok and result.plan is not None:
        type(result.plan).from_json(result.plan.to_json())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_random_text(text):
    _assert_only_diagnostics(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(TOKENS), max_size=60))
def test_random_token_soup(tokens):
    _assert_only_diagnostics(" ".join(tokens))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SEEDS), st.data())
def test_mutated_pipelines(seed, data):
    text = seed
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["delete", "insert", "replace", "duplicate"]))
        i = data.draw(st.integers(0, len(text)))
        j = min(len(text), i + data.draw(st.integers(0, 30)))
        if op == "delete":
            text = text[:i] + text[j:]
        elif op == "insert":
            text = text[:i] + data.draw(st.sampled_from(TOKENS)) + text[i:]
        elif op == "replace":
            text = text[:i] + data.draw(st.sampled_from(TOKENS)) + text[j:]
        else:
            text = text[:j] + text[i:j] + text[j:]
    _assert_only_diagnostics(text)


def test_the_fuzz_benchmark_finds_no_traceback_in_a_few_thousand_inputs():
    """bench/fuzz.py at CI size: random bytes, token soup, mutations, deep
    nesting, megabyte lines and Unicode line separators (100k in the benchmark)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz.py"), "--inputs", "2000", "--seed", "7"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "tracebacks: 0" in proc.stdout
