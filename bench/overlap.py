"""How close the async controller gets to the overlap limit, on sim engines.

    python bench/overlap.py [--steps 10] [--gen 0.4] [--train 0.25]

Disaggregated: one generator takes G for a step's worth of prompt groups
(G / prompts_per_step per group, back to back) while the trainer takes T per
step, so the ideal step time is G + T synchronously and max(G, T) fully
overlapped. Two trainer cost profiles:

- ``finish``: all of T in ``finish_train_step`` (nothing overlaps inside a
  step), so ``max_lag = 0`` is the synchronous baseline G + T;
- ``stream``: 90 % of T spread over the per-group microbatches, 10 % at
  finish, so even ``max_lag = 0`` hides most training under generation.

Step times are steady-state: (time of the last finished step - time of the
first) / (steps - 1), so the pipeline's initial fill is left out. Each
(G, T) pair is also run swapped, to cover both the generation-bound and the
training-bound regime. The last lines give the controller's own overhead per
sample: zero-latency runs, once on sim engines with the in-memory data plane
and once on no-op handles (the controller alone).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time

from rldsl.runtime.control.controller import Controller
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.dataplane import InMemoryDataPlane
from rldsl.runtime.engines.sim import Latency
from rldsl.runtime.inprocess import SimConfig, SimStages
from rldsl.runtime.protocols import Prompt

from null_stages import NullDataPlane, null_handles

PROMPTS_PER_STEP = 8
SAMPLES_PER_PROMPT = 4


def prompts():
    return (Prompt(i, f"question {i}", "answer") for i in itertools.count())


def run_settings(max_lag: int, steps: int) -> RunSettings:
    return RunSettings(
        pipeline="bench",
        prompts_per_step=PROMPTS_PER_STEP,
        samples_per_prompt=SAMPLES_PER_PROMPT,
        steps=steps,
        max_lag=max_lag,
        too_stale="drop",  # as measured in docs/performance.md: the train pump never idles on a ready group
        generate_concurrency=1,  # one group per call, back to back: G is a step's groups in sequence
        reward_stages=("score",),
        watchdog_timeout_s=60.0,
    )


def steady_step_time(gen_s: float, train_s: float, max_lag: int, profile: str, steps: int) -> tuple[float, dict]:
    settings = run_settings(max_lag, steps)
    stream_share = 0.9 if profile == "stream" else 0.0
    config = SimConfig(
        generate=Latency.constant(gen_s / PROMPTS_PER_STEP),
        microbatch=Latency.constant(stream_share * train_s / PROMPTS_PER_STEP),
        finish=Latency.constant((1 - stream_share) * train_s),
    )
    dataplane = InMemoryDataPlane()
    records: list[dict] = []
    controller = Controller(
        settings, SimStages(settings, dataplane, config).handles, dataplane, prompts(), on_step=records.append
    )
    summary = asyncio.run(controller.run())
    first, last = records[0]["elapsed_s"], records[-1]["elapsed_s"]
    return (last - first) / (len(records) - 1), summary


def overlap_table(gen_s: float, train_s: float, steps: int) -> list[str]:
    ideal = max(gen_s, train_s)
    lines = [
        f"G = {gen_s:.2f} s, T = {train_s:.2f} s: sync limit G + T = {gen_s + train_s:.2f} s, "
        f"async limit max(G, T) = {ideal:.2f} s",
        f"  {'trainer':8} {'max_lag':>7} {'step s':>8} {'steps/s':>8} {'step/max(G,T)':>14} {'lag histogram':>20}",
    ]
    times: dict[tuple[str, int], float] = {}
    for profile in ("finish", "stream"):
        for max_lag in (0, 1, 2):
            step_s, summary = steady_step_time(gen_s, train_s, max_lag, profile, steps)
            times[profile, max_lag] = step_s
            lags = summary["ledger"]["lag_histogram"]
            lines.append(
                f"  {profile:8} {max_lag:>7} {step_s:>8.3f} {1 / step_s:>8.2f} {step_s / ideal:>14.3f} {str(lags):>20}"
            )
    limit = (gen_s + train_s) / ideal
    speedup = times["finish", 0] / times["finish", 1]
    lines.append(
        f"  sync -> async speedup (finish trainer, max_lag 0 -> 1): {speedup:.3f}x, "
        f"limit (G+T)/max(G,T) = {limit:.3f}x, reached {speedup / limit:.1%} of it"
    )
    return lines


def overhead_per_sample(steps: int, with_engines: bool) -> float:
    settings = run_settings(max_lag=1, steps=steps)
    if with_engines:
        dataplane = InMemoryDataPlane()
        handles = SimStages(settings, dataplane, SimConfig()).handles
    else:
        dataplane, handles = NullDataPlane(), null_handles()
    started = time.perf_counter()
    summary = asyncio.run(Controller(settings, handles, dataplane, prompts()).run())
    return (time.perf_counter() - started) / summary["ledger"]["trained"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps per measurement")
    parser.add_argument("--gen", type=float, default=0.4, help="G: generation seconds per step")
    parser.add_argument("--train", type=float, default=0.25, help="T: training seconds per step")
    args = parser.parse_args()
    print(f"{PROMPTS_PER_STEP} prompt groups x {SAMPLES_PER_PROMPT} samples per step, {args.steps} steps per run\n")
    for gen_s, train_s in ((args.gen, args.train), (args.train, args.gen)):
        print("\n".join(overlap_table(gen_s, train_s, args.steps)), end="\n\n")
    for with_engines in (False, True):
        label = "controller + sim engines + data plane" if with_engines else "controller alone (no-op handles)"
        per_sample = min(overhead_per_sample(100, with_engines) for _ in range(3))  # best of 3: the CPU is shared
        group_us = per_sample * SAMPLES_PER_PROMPT * 1e6
        print(f"overhead, {label}: {per_sample * 1e6:.0f} us/sample ({group_us:.0f} us/group)")


if __name__ == "__main__":
    main()
