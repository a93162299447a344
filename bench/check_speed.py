"""`rldsl check` start-up against a bare import of the CLI's own libraries,
measured side by side (interleaved) in one run, a 200-stage pipeline, and
clusters of 128, 512 and 1024 nodes x 8 GPUs (check must stay linear in the
cluster's size: 1024 x 8 under 2 s).

    python bench/check_speed.py [--repeat 15] [--nodes 128,512,1024] [--clusters-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "import lark, networkx"  # what check itself imports; rich, torch and ray are not


# As on a user's machine: bytecode cached. (Some containers set
# PYTHONDONTWRITEBYTECODE, which would time compiling our sources on every
# start while the libraries, byte-compiled at install, load from .pyc.)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    return time.perf_counter() - start


def big_pipeline(n_stages: int) -> str:
    """A valid pipeline with n stages: chains of reward and logprob stages."""
    lines = ["pipeline big", "cluster { nodes = 4  gpus_per_node = 8 }",
             'model policy { source = "builtin:tiny-lm" }', 'dataset prompts { source = "builtin:arith" }',
             "stage generate rollout { model = policy  gpus = 8  samples_per_prompt = 8 }",
             "stage train actor { model = policy  gpus = 8  prompts_per_step = 16 }",
             "stage sync weights { from = actor  to = rollout }"]
    chain = ["prompts", "rollout"]
    for i in range(n_stages - 3):  # + rollout, actor and the sync stage
        if i % 2:
            lines.append(f'stage reward r{i} {{ fn = "rldsl.rewards:exact_match" }}')
        else:
            lines.append(f"stage logprob l{i} {{ model = policy  frozen  colocate = actor }}")
        chain.append(f"r{i}" if i % 2 else f"l{i}")
    lines.append("flow " + " -> ".join(chain + ["actor"]))
    lines.append("staleness { max_lag = 1 }")
    return "\n".join(lines) + "\n"


def cluster_pipeline(nodes: int, gpus_per_node: int = 8) -> str:
    """A 7B pipeline over the whole cluster, as gpu_cluster.rlp on more nodes: vLLM (tp = 2) generates on
    half the GPUs, megatron (tp = 2) trains on the other half with the frozen reference colocated, and the
    memory check (`gpu_memory`) runs on every GPU."""
    half = nodes * gpus_per_node // 2
    return "\n".join([
        "pipeline cluster_scale",
        f"cluster {{ nodes = {nodes}  gpus_per_node = {gpus_per_node}  gpu_memory = 80GiB }}",
        'model policy { source = "hf:/models/Qwen2.5-7B-Instruct"  params = 7B }',
        'dataset prompts { source = "builtin:arith" }',
        f"stage generate rollout {{ model = policy  engine = vllm(tp = 2, gpu_memory = 85%)  gpus = {half}  "
        "samples_per_prompt = 8  max_new_tokens = 1024 }",
        'stage reward score { fn = "rldsl.rewards:exact_match" }',
        "stage logprob reference { model = policy  frozen  engine = megatron(tp = 2)  colocate = actor  "
        "micro_batch = 2 }",
        f"stage train actor {{ model = policy  engine = megatron(tp = 2)  gpus = {half}  "
        f"prompts_per_step = {half // 8}  micro_batch = 1 }}",
        "stage sync weights { from = actor  to = rollout }",
        "flow prompts -> rollout -> score -> reference -> actor",
        "staleness { max_lag = 1 }", ""])


def cluster_figures(entry: list[str], sizes: list[int]) -> None:
    """`check` on clusters of growing size: in process (as `check` compiles, without a plan to save), best
    of 3, and the whole `rldsl check` process once."""
    from rldsl.compiler.driver import compile_source

    print(f"{'check on a cluster (goal: 1024 x 8 < 2 s)':<46} {'in process s':>12} {'process s':>10}")
    for nodes in sizes:
        text = cluster_pipeline(nodes)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            result = compile_source(text, "cluster.rlp", want_plan=False)
            times.append(time.perf_counter() - start)
        assert result.ok, [(d.code, d.message) for d in result.diagnostics[:3]]
        with tempfile.NamedTemporaryFile("w", suffix=".rlp", delete=False) as f:
            f.write(text)
        proc = wall([*entry, "check", f.name])
        print(f"{f'{nodes} nodes x 8 GPUs':<46} {min(times):>12.3f} {proc:>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--nodes", default="128,512,1024", help="cluster sizes to check, in nodes of 8 GPUs")
    parser.add_argument("--clusters-only", action="store_true", help="only the cluster figures")
    args = parser.parse_args()
    # the console script installed beside this interpreter, as users run it
    # (not a version-manager shim on PATH, which would time the shim)
    script = Path(sys.executable).parent / "rldsl"
    entry = [str(script)] if script.exists() else [sys.executable, "-m", "rldsl"]
    if args.clusters_only:
        cluster_figures(entry, [int(n) for n in args.nodes.split(",")])
        return
    check = [*entry, "check", str(ROOT / "pipelines" / "grpo_async.rlp")]
    base = [sys.executable, "-c", BASELINE]
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "rldsl")], check=True, env=ENV)
    wall(check), wall(base)  # warm the file cache and lark's grammar cache
    checks, bases = [], []
    for _ in range(args.repeat):  # interleaved, so drift hits both alike
        checks.append(wall(check))
        bases.append(wall(base))
    c, b = statistics.median(checks), statistics.median(bases)
    cb, bb = min(checks), min(bases)  # best of N: the least disturbed start-up
    print(f"{'measure':<46} {'median s':>9} {'best s':>8}")
    print(f"{'python -c ' + repr(BASELINE):<46} {b:>9.3f} {bb:>8.3f}")
    print(f"{'rldsl check pipelines/grpo_async.rlp':<46} {c:>9.3f} {cb:>8.3f}")
    print(f"{'ratio (goal <= 1.30)':<46} {c / b:>9.2f} {cb / bb:>8.2f}")

    from rldsl.compiler.driver import compile_source

    text = big_pipeline(200)
    compile_source(text)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        result = compile_source(text, "big.rlp")
        times.append(time.perf_counter() - start)
    assert result.ok, result.diagnostics[:3]
    stages = len(result.plan.pipeline().stages)
    print(f"{f'compile a {stages}-stage pipeline, in process':<46} {statistics.median(times):>9.3f}")
    with tempfile.NamedTemporaryFile("w", suffix=".rlp", delete=False) as f:
        f.write(text)
    proc = statistics.median(wall([*entry, "check", f.name]) for _ in range(5))
    print(f"{'rldsl check on it, whole process (goal < 1 s)':<46} {proc:>9.3f}")
    cluster_figures(entry, [int(n) for n in args.nodes.split(",")])


if __name__ == "__main__":
    main()
