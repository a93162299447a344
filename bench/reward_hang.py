"""Reward throughput when the reward hangs on some samples.

Scores calls of 8 samples (one group of the default pipeline) through the
reward layer, with a reward that spins, holding a CPU, on 2% of the samples
and a 0.5 s timeout, against the same reward without hangs. Three ways:

- thread guard: what reward workers did before, ``rldsl.rewards.safe_reward``
  per sample with the timeout (a daemon thread, abandoned when it overruns);
- process pool, 1 caller: ``RewardPool`` (the stage's default 2 processes,
  and 4), one call at a time, as a reward worker serves them;
- process pool, 4 callers: four threads calling the same pool at once.

The thread guard runs last: the threads it abandons keep spinning.

    python bench/reward_hang.py [--samples 1000] [--timeout 0.5] [--hang-every 50]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from rldsl.rewards import exact_match, safe_reward
from rldsl.runtime.protocols import RewardFailure
from rldsl.runtime.reward_pool import DEFAULT_PROCESSES, RewardPool

GROUP = 8
HANG_S = 120.0  # "forever", but bounded so an abandoned thread ends eventually
THIS_MODULE = __spec__.name if __spec__ is not None else Path(__file__).stem  # how reward processes import it


def hanging_reward(response: str, answer: str, prompt: str) -> float:
    """exact_match, except that it spins on the response "hang"."""
    if response == "hang":
        end = time.monotonic() + HANG_S
        while time.monotonic() < end:
            pass
    return exact_match(response, answer, prompt)


def calls(samples: int, hang_every: int | None) -> list[list[tuple[str, str, str]]]:
    rows = [("hang" if hang_every and i % hang_every == hang_every // 2 else str(i % 7), "3", "1+2=")
            for i in range(samples)]
    return [rows[i:i + GROUP] for i in range(0, samples, GROUP)]


def thread_guard(work: list, timeout_s: float) -> tuple[float, int]:
    started, dropped = time.perf_counter(), 0
    for call in work:
        for response, answer, prompt in call:
            dropped += safe_reward(hanging_reward, response, answer, prompt, timeout_s)[0] is None
    return time.perf_counter() - started, dropped


def process_pool(pool: RewardPool, work: list, callers: int) -> tuple[float, int]:
    pending, dropped, lock = list(reversed(work)), [0], threading.Lock()

    def caller() -> None:
        while True:
            with lock:
                if not pending:
                    return
                call = pending.pop()
            failed = sum(isinstance(r, RewardFailure) for r in pool.score(call))
            with lock:
                dropped[0] += failed

    started = time.perf_counter()
    threads = [threading.Thread(target=caller) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, dropped[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1000, help="samples per measurement with hangs")
    parser.add_argument("--timeout", type=float, default=0.5)
    parser.add_argument("--hang-every", type=int, default=50, help="one sample in N hangs (50: 2%%)")
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    clean_samples = args.samples * 10  # without hangs a run is short: more samples for a steady figure
    figures: dict[str, dict[str, str]] = {}

    def record(name: str, hang: bool, elapsed: float, dropped: int, samples: int) -> None:
        figures.setdefault(name, {})[hang] = f"{samples / elapsed:8.0f} ({dropped} dropped)"
        print(f"  {name}, {'2% hang' if hang else 'no hang'}: {samples / elapsed:.0f} samples/s", flush=True)

    for processes in sorted({DEFAULT_PROCESSES, 4}):
        pool = RewardPool(f"{THIS_MODULE}:hanging_reward", processes, args.timeout)
        pool.wait_ready()
        try:
            for callers in (1, 4):
                name = f"process pool ({processes} proc), {callers} caller{'s' * (callers > 1)}"
                record(name, False, *process_pool(pool, calls(clean_samples, None), callers), clean_samples)
                record(name, True, *process_pool(pool, calls(args.samples, args.hang_every), callers), args.samples)
        finally:
            pool.close()
    name = "thread guard (before), 1 caller"
    record(name, False, *thread_guard(calls(clean_samples, None), args.timeout), clean_samples)
    record(name, True, *thread_guard(calls(args.samples, args.hang_every), args.timeout), args.samples)

    print(f"\nreward layer throughput, samples/s; calls of {GROUP} samples, timeout {args.timeout:g}s, "
          f"1 in {args.hang_every} samples hangs (spins until killed or abandoned)")
    print(f"{'':40}{'no hang':>22}{'with hangs':>22}")
    for name, row in figures.items():
        print(f"{name:40}{row[False]:>22}{row[True]:>22}")
    print(f"load average {_load(load_at_start)} at start, {_load(os.getloadavg())} at the end (the hangs spin "
          f"too); {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    os._exit(0)  # do not wait for the threads the thread guard abandoned


def _load(averages: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in averages)


if __name__ == "__main__":
    main()
