"""GPU time-sharing across pipelines, on sim engines in one process.

    python bench/gpu_sharing.py [--steps 12]

Two identical on-policy GRPO pipelines and 4 GPUs. Each step is 8 prompts x
4 samples; generation is compute-bound (twice the replicas, half the time),
the reward is a slow verifier during which a pipeline's GPUs would idle,
and the trainer is dp 2. Three ways, side by side:

- static split: each pipeline alone on 2 GPUs (trainer and 2 replicas
  colocated), both running at once;
- shared: both on all 4 GPUs (4 replicas each, trainers on GPUs 0-1 and
  2-3), taking turns through the lease scheduler;
- one after the other: each alone on all 4 GPUs (its solo rate).

Goal: shared aggregate >= 1.3x the static split's, each pipeline >= 0.5x
of its solo rate.
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
from rldsl.runtime.inprocess.sharing import SharingPipeline, run_sharing
from rldsl.runtime.protocols import Prompt

PIPELINES = ("a", "b")
GROUPS, SAMPLES = 8, 4
GROUP_S = 0.15  # generation is compute-bound: a batch of n groups takes n x 0.15 s on one replica
REWARD_S = 0.4  # a slow verifier (a sandbox, a judge): the GPUs idle while the last groups are scored
MICRO_S = 0.01  # a microbatch; the trainer is dp 2


def config(replicas: int) -> SimConfig:
    """Twice the replicas, half the generation time."""
    return SimConfig(generate=Latency.constant(GROUP_S), generate_per_group=GROUP_S, generators=replicas,
                     reward=Latency.constant(REWARD_S), reward_workers=GROUPS, microbatch=Latency.constant(MICRO_S),
                     finish=Latency.constant(0.02), train_replicas=2)


def settings(name: str, steps: int, trainer_replicas: tuple[int, ...],
             leases: tuple[tuple[str, ...], ...] = (), trainer_lease: tuple[str, ...] = ()) -> RunSettings:
    return RunSettings(pipeline=name, prompts_per_step=GROUPS, samples_per_prompt=SAMPLES, steps=steps, max_lag=0,
                       reward_stages=("score",), watchdog_timeout_s=60, sleeping_replicas=trainer_replicas,
                       replica_leases=leases, trainer_lease=trainer_lease)


async def _alone(name: str, steps: int, replicas: int, trainer_replicas: tuple[int, ...]) -> dict:
    run = settings(name, steps, trainer_replicas)
    dataplane = InMemoryDataPlane()
    prompts = (Prompt(i, f"question {i}", "answer") for i in itertools.count())
    return await Controller(run, SimStages(run, dataplane, config(replicas)).handles, dataplane, prompts).run()


async def static_split(steps: int) -> dict[str, dict]:
    results = await asyncio.gather(*(_alone(name, steps, 2, (0, 1)) for name in PIPELINES))
    return dict(zip(PIPELINES, results))


async def one_after_the_other(steps: int) -> dict[str, dict]:
    return {name: await _alone(name, steps, 4, (0, 1)) for name in PIPELINES}


async def shared(steps: int) -> dict[str, dict]:
    every_gpu = tuple((f"0:{gpu}",) for gpu in range(4))
    trainers = {"a": (0, 1), "b": (2, 3)}
    pipelines = [SharingPipeline(settings(name, steps, trainers[name], every_gpu,
                                          tuple(f"0:{gpu}" for gpu in trainers[name])), config(4))
                 for name in PIPELINES]
    summaries, board = await run_sharing(pipelines)
    assert not board.resident, f"GPUs still held after the run: {board.resident}"
    return summaries


def _rate(summary: dict) -> float:
    return summary["ledger"]["trained"] / summary["elapsed_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    steps = parser.parse_args().steps
    timed = {}
    for name, scenario in (("static split 2 + 2", static_split), ("shared 4", shared),
                           ("one after the other", one_after_the_other)):
        started = time.monotonic()
        summaries = asyncio.run(scenario(steps))
        timed[name] = (time.monotonic() - started, summaries)
    print(f"two on-policy pipelines, {steps} steps each of {GROUPS} x {SAMPLES} samples, 4 GPUs")
    print(f"  {'':<22}{'wall s':>8}{'aggregate/s':>13}{'a/s':>8}{'b/s':>8}{'a waited':>10}{'b waited':>10}")
    for name, (wall, summaries) in timed.items():
        trained = sum(s["ledger"]["trained"] for s in summaries.values())
        waits = [s.get("gpu_sharing", {}).get("gpu_seconds_waited") for s in summaries.values()]
        waited = "".join(f"{w:>9.1f}s" if w is not None else f"{'-':>10}" for w in waits)
        print(f"  {name:<22}{wall:>8.2f}{trained / wall:>13.1f}{_rate(summaries['a']):>8.1f}"
              f"{_rate(summaries['b']):>8.1f}{waited}")
    static_wall, static = timed["static split 2 + 2"]
    shared_wall, sharing = timed["shared 4"]
    _, solo = timed["one after the other"]
    aggregate = (sum(s["ledger"]["trained"] for s in sharing.values()) / shared_wall) / \
        (sum(s["ledger"]["trained"] for s in static.values()) / static_wall)
    for name in PIPELINES:
        stats = sharing[name]["gpu_sharing"]
        print(f"  {name}: {_rate(sharing[name]) / _rate(solo[name]):.2f}x of its solo rate shared; "
              f"{stats['gpu_seconds_used']:.1f} GPU-s held, {stats['gpu_seconds_waited']:.1f} GPU-s waited over "
              f"{stats['lease_waits']} waits, {stats['revocations']} leases asked back")
    print(f"aggregate: {aggregate:.2f}x the static split")


if __name__ == "__main__":
    main()
