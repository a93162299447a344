"""Every replica busy, on sim engines in one process.

    python bench/replicas.py [--steps 8]

Three measurements, each side by side in one run:

- data-parallel scaling: a training-bound step (16 groups, 50 ms per
  microbatch, fast generation) at dp 1, 2, 4 and 8; the train phase is the
  steady step time, and its speed-up over dp 1 should be >= 0.85 x dp;
- partial overlap against full colocation on the same two generator
  replicas, G ~ T: colocated, both replicas sleep while a step trains;
  partial, only the replica on the trainer's GPU does (goal >= 1.3x);
- batched generation: one replica serving a step's groups as one batch
  against one group per call.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

from rldsl.runtime.control.controller import Controller
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.dataplane import InMemoryDataPlane
from rldsl.runtime.engines.sim import Latency
from rldsl.runtime.inprocess import SimConfig, SimStages
from rldsl.runtime.protocols import Prompt


def prompts():
    return (Prompt(i, f"question {i}", "answer") for i in itertools.count())


def steady_run(settings: RunSettings, config: SimConfig) -> tuple[float, dict]:
    """Steady-state seconds per step (the first step's fill left out) and the summary."""
    dataplane = InMemoryDataPlane()
    records: list[dict] = []
    controller = Controller(settings, SimStages(settings, dataplane, config).handles, dataplane, prompts(),
                            on_step=records.append)
    summary = asyncio.run(controller.run())
    return (records[-1]["elapsed_s"] - records[0]["elapsed_s"]) / (len(records) - 1), summary


def data_parallel_scaling(steps: int) -> list[str]:
    settings = RunSettings(pipeline="bench", prompts_per_step=16, samples_per_prompt=4, steps=steps, max_lag=1,
                           watchdog_timeout_s=60)
    lines = ["data-parallel scaling: 16 groups per step, 50 ms per microbatch, 10 ms finish, fast generation",
             f"  {'dp':>3} {'step s':>8} {'speed-up':>9} {'/ dp':>6}"]
    base = None
    worst = float("inf")
    for dp in (1, 2, 4, 8):
        config = SimConfig(generate=Latency.constant(0.005), generators=2, microbatch=Latency.constant(0.05),
                           finish=Latency.constant(0.01), train_replicas=dp)
        step_s, _ = steady_run(settings, config)
        base = base or step_s
        speedup = base / step_s
        if dp > 1:
            worst = min(worst, speedup / dp)
        lines.append(f"  {dp:>3} {step_s:>8.3f} {speedup:>8.2f}x {speedup / dp:>6.2f}")
    lines.append(f"  worst speed-up / dp: {worst:.2f} (goal >= 0.85: {'met' if worst >= 0.85 else 'NOT met'})")
    return lines


def partial_overlap(steps: int) -> list[str]:
    """Two replicas, one group at a time each (50 ms): G = 8 groups / 2 = 0.2 s; T = 8 x 20 ms + 40 ms = 0.2 s."""
    config = SimConfig(generate=Latency.constant(0.05), generators=2, microbatch=Latency.constant(0.02),
                       finish=Latency.constant(0.04))
    lines = ["partial overlap vs full colocation: 2 generator replicas, 8 groups per step, G ~ T ~ 0.2 s, max_lag 1",
             f"  {'placement':<32} {'step s':>8} {'samples/s':>10}"]
    rates = {}
    for label, sleeping in (("colocated (both replicas sleep)", (0, 1)), ("partial (replica 0 sleeps)", (0,))):
        settings = RunSettings(pipeline="bench", prompts_per_step=8, samples_per_prompt=4, steps=steps, max_lag=1,
                               generate_concurrency=1, sleeping_replicas=sleeping, watchdog_timeout_s=60)
        step_s, _ = steady_run(settings, config)
        rates[label] = settings.samples_per_step / step_s
        lines.append(f"  {label:<32} {step_s:>8.3f} {rates[label]:>10.1f}")
    ratio = rates["partial (replica 0 sleeps)"] / rates["colocated (both replicas sleep)"]
    verdict = "met" if ratio >= 1.3 else "NOT met"
    lines.append(f"  partial / colocated throughput: {ratio:.2f}x (goal >= 1.3: {verdict})")
    return lines


def batched_generation(steps: int) -> list[str]:
    """One replica, 100 ms per call plus 10 ms per extra group in it; the trainer is fast."""
    lines = ["batched generation: 1 replica, 8 groups per step, 100 ms per call + 10 ms per extra group",
             f"  {'groups per call':<22} {'step s':>8} {'samples/s':>10}"]
    rates = {}
    for label, concurrency in (("one (concurrency 1)", 1), ("a step (derived)", 0)):
        settings = RunSettings(pipeline="bench", prompts_per_step=8, samples_per_prompt=4, steps=steps, max_lag=1,
                               generate_concurrency=concurrency, watchdog_timeout_s=60)
        config = SimConfig(generate=Latency.constant(0.1), generate_per_group=0.01, microbatch=Latency.constant(0.001))
        step_s, _ = steady_run(settings, config)
        rates[label] = settings.samples_per_step / step_s
        lines.append(f"  {label:<22} {step_s:>8.3f} {rates[label]:>10.1f}")
    ratio = rates["a step (derived)"] / rates["one (concurrency 1)"]
    lines.append(f"  batched / one group per call: {ratio:.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per measurement")
    args = parser.parse_args()
    for section in (data_parallel_scaling, partial_overlap, batched_generation):
        print("\n".join(section(args.steps)), end="\n\n")


if __name__ == "__main__":
    main()
