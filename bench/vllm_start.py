"""A one-worker vLLM engine's start and first generation on a CPU, with its
worker in the engine's process (what `start_engine` picks there, as vLLM
does on a GPU) against vLLM's own CPU layout (a process for the worker
beside the engine's, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``), alternated in
one run on the test suite's shared tiny Llama (head_dim 64, fp32; tests/vllm_engines.py).

Printed per start: the layout, seconds to a started engine, seconds for one
GRPO group (8 samples x 16 tokens) after it, and the medians per layout.

    python bench/vllm_start.py [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {"in the engine's process": "0", "a process of its own": "1"}


def start_and_generate(model_dir: Path, multiprocessing: str) -> tuple[float, float]:
    from rldsl.runtime.engines.vllm import VLLMGenerator
    from rldsl.runtime.protocols import Prompt
    from tests.vllm_engines import shared_engine_options

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing  # read by the engine process it spawns
    started = time.perf_counter()
    engine = VLLMGenerator.from_path(str(model_dir), shared_engine_options(), seed=0, max_new_tokens=16,
                                     temperature=1.0)
    start_s = time.perf_counter() - started
    try:
        started = time.perf_counter()
        engine.generate([Prompt(0, "12+7=", "19")], samples_per_prompt=8, seed=1)
        return start_s, time.perf_counter() - started
    finally:
        engine.llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.vllm_engines import save_shared_model

    model_dir = save_shared_model(Path(tempfile.mkdtemp(prefix="vllm-start-")) / "model")
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in LAYOUTS}
    print("| worker | start s | first group s |\n|---|---:|---:|")
    for _ in range(args.reps):
        for name, value in LAYOUTS.items():
            start_s, group_s = start_and_generate(model_dir, value)
            times[name].append((start_s, group_s))
            print(f"| {name} | {start_s:.1f} | {group_s:.2f} |", flush=True)
    for name, runs in times.items():
        print(f"| **{name}, median** | **{statistics.median(s for s, _ in runs):.1f}** | "
              f"**{statistics.median(g for _, g in runs):.2f}** |")


if __name__ == "__main__":
    main()
