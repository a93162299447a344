"""Fuzz `check` and `plan` at scale: nothing may ever raise.

Inputs, in equal shares: random bytes (decoded as the CLI would, or with
replacement characters), token soup from the language's words, mutations of
the shipped pipelines and golden examples, deep nesting, very long lines, and
the shipped pipelines with every Unicode line separator sprinkled in. Each
goes through the compiler (check), the text, JSON and SARIF renderers, and,
when it compiles, the plan view and the plan's JSON round trip.

    python bench/fuzz.py [--inputs 100000] [--seed 0]

Prints inputs/s, the number of tracebacks (goal 0; the first few are shown)
and the slowest input (goal < 2 s). Exit 1 on any traceback.
"""

from __future__ import annotations

import argparse
import random
import time
import traceback
from pathlib import Path

from rldsl.compiler.diagnostics import render_text, to_json, to_sarif
from rldsl.compiler.driver import compile_source
from rldsl.compiler.plan_view import render_plan
from rldsl.plan import ExecutionPlan

ROOT = Path(__file__).resolve().parent.parent
SEEDS = [p.read_text() for p in sorted((ROOT / "pipelines").glob("*.rlp"))] + \
        [p.read_text() for p in sorted((ROOT / "tests" / "golden").glob("*.rlp"))]
TOKENS = ["pipeline", "stage", "flow", "->", "{", "}", "[", "]", "(", ")", "=", ",", "..", "generate", "train",
          "reward", "logprob", "sync", "model", "dataset", "cluster", "staleness", "buffer", "placement", "run",
          "policy", "actor", "rollout", "score", "reference", "prompts", "gpus", "0", "1", "8", "-3", "1e9",
          "2..3", "256MiB", "30s", "50%", "7B", '"builtin:tiny-lm"', '"builtin:arith"', "true", "false", "frozen",
          "vllm(tp = 2)", "megatron(tp = 2, pp = 2)", "sim(latency = 10ms)", "torch", "grpo(kl = 0.1)",
          "max_lag", "samples_per_prompt", "prompts_per_step", "micro_batch", "colocate", "groups", "ratios",
          "\n", " ", "\t", "#", '"', "\\"]
SEPARATORS = ["\f", "\v", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r", "\r\n"]


def random_bytes(rng: random.Random) -> str:
    data = bytes(rng.randrange(256) for _ in range(rng.randrange(400)))
    return data.decode("utf-8", errors=rng.choice(["replace", "ignore"]))


def token_soup(rng: random.Random) -> str:
    return rng.choice(["", " ", "\n"]).join(rng.choice(TOKENS) for _ in range(rng.randrange(120)))


def mutation(rng: random.Random) -> str:
    text = rng.choice(SEEDS)
    for _ in range(rng.randint(1, 6)):
        i = rng.randrange(len(text) + 1)
        j = min(len(text), i + rng.randrange(40))
        op = rng.choice(["delete", "insert", "replace", "duplicate", "swap_lines"])
        if op == "delete":
            text = text[:i] + text[j:]
        elif op == "insert":
            text = text[:i] + rng.choice(TOKENS) + text[i:]
        elif op == "replace":
            text = text[:i] + rng.choice(TOKENS) + text[j:]
        elif op == "duplicate":
            text = text[:j] + text[i:j] + text[j:]
        else:
            lines = text.split("\n")
            a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
            lines[a], lines[b] = lines[b], lines[a]
            text = "\n".join(lines)
    return text


def deep_nesting(rng: random.Random) -> str:
    depth = rng.choice([10, 32, 33, 100, 1000, 20_000])
    opening, closing = rng.choice([("[", "]"), ("(", ")"), ("{", "}"), ("sim(", ")")])
    value = opening * depth + rng.choice(["", "1", "a"]) + closing * rng.choice([depth, depth // 2, 0])
    seed = rng.choice(SEEDS)
    return seed.replace("}\n", f"  x = {value}\n}}\n", 1)


def long_line(rng: random.Random) -> str:
    filler = rng.choice([" ", "a", "1", "# ", '"'])
    line = filler * rng.choice([10_000, 200_000, 2_000_000])
    seed = rng.choice(SEEDS)
    at = rng.randrange(len(seed) + 1)
    return seed[:at] + line + rng.choice(["", " bogus = 1", "}"]) + seed[at:]


def separators(rng: random.Random) -> str:
    text = rng.choice(SEEDS)
    for _ in range(rng.randint(1, 5)):
        i = rng.randrange(len(text) + 1)
        text = text[:i] + rng.choice(SEPARATORS) + text[i:]
    return text


GENERATORS = [random_bytes, token_soup, mutation, deep_nesting, long_line, separators]


def exercise(text: str) -> None:
    """What `check --format text|json|sarif` and `plan` do with one input."""
    result = compile_source(text, "fuzz.rlp")
    render_text(result.diagnostics, text, "fuzz.rlp")
    to_json(result.diagnostics, "fuzz.rlp")
    to_sarif(result.diagnostics, "fuzz.rlp", {})
    if result.ok and result.plan is not None:
        render_plan(result)
        ExecutionPlan.from_json(result.plan.to_json())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    failures: list[tuple[str, str, str]] = []
    slowest = (0.0, "", "")
    started = time.perf_counter()
    for index in range(args.inputs):
        generator = GENERATORS[index % len(GENERATORS)]
        text = generator(rng)
        began = time.perf_counter()
        try:
            exercise(text)
        except Exception:  # noqa: BLE001 - counting them is the point
            failures.append((generator.__name__, text, traceback.format_exc()))
        took = time.perf_counter() - began
        if took > slowest[0]:
            slowest = (took, generator.__name__, text[:80])
    elapsed = time.perf_counter() - started
    print(f"inputs: {args.inputs} in {elapsed:.1f} s ({args.inputs / elapsed:.0f} inputs/s), seed {args.seed}")
    print(f"tracebacks: {len(failures)} (goal 0)")
    print(f"slowest input: {slowest[0]:.3f} s ({slowest[1]}: {slowest[2]!r}) (goal < 2 s)")
    for name, text, trace in failures[:3]:
        print(f"--- {name}: {text[:200]!r}\n{trace}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
