"""Generation that streams against whole-batch waves, on one sim replica.

    python bench/streaming_generation.py [--groups 32] [--seed 0]

One generator replica (a ContinuousBatcher over the sim engine) serves
prompt groups whose decode times have a long tail (lognormal, median 40 ms,
sigma 0.5, and one group in ten 8x longer), side by side in one run:

- waves: the engine's whole-batch call (vLLM's and SGLang's offline
  engines before streaming): every queued group goes into one call, which
  lasts as long as its longest group; groups arriving meanwhile wait for
  the next call;
- streaming: each group is started the moment it is admitted and answered
  the moment it ends (the async engines, the sim engine in a run).

Both modes draw the same decode time for the same group (one seeded draw
per group, in admission order) and pay the same batching cost (``per_group``
for each other group decoding with it). Two measurements:

- a step's groups dispatched at once: time until the first group is back
  at the controller (it can be scored and trained on from then), the mean
  and the last; goal: first group >= 1.5x sooner streaming;
- a replica kept full (``--concurrency`` groups in flight, a new group
  dispatched as each returns, as the rollout pump does): groups per second
  and the mean time a group takes.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from rldsl.runtime.engines.batching import ContinuousBatcher
from rldsl.runtime.engines.sim import Latency, SimGenerator
from rldsl.runtime.protocols import Prompt

LATENCY = Latency.lognormal(0.04, sigma=0.5, tail_prob=0.1, tail_mult=8.0)
PER_GROUP = 0.001  # batching cost per other group decoding alongside


def engine(streaming: bool, seed: int) -> SimGenerator:
    return SimGenerator(LATENCY, max_new_tokens=16, seed=seed, per_group=PER_GROUP, streaming=streaming,
                        longest_in_wave=True)


def request(index: int) -> tuple[list[Prompt], int, int]:
    return [Prompt(index, f"question {index}", "answer")], 8, index


def one_step(streaming: bool, groups: int, seed: int) -> list[float]:
    """Seconds from dispatch until each group is answered, in the order answered."""
    batcher = ContinuousBatcher(engine(streaming, seed))
    batcher.sleep()  # hold the step's groups in the queue, so both modes start from the same full queue
    answered: list[float] = []
    lock = threading.Lock()

    def submit(index: int) -> None:
        batcher.submit(*request(index))
        with lock:
            answered.append(time.perf_counter() - started)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(groups)]
    for thread in threads:
        thread.start()
    while batcher.stats()["queued"] < groups:
        time.sleep(0.001)
    started = time.perf_counter()
    batcher.wake()
    for thread in threads:
        thread.join()
    batcher.close()
    return sorted(answered)


def kept_full(streaming: bool, groups: int, concurrency: int, seed: int) -> tuple[float, float]:
    """Groups per second and mean seconds per group with ``concurrency`` groups always in flight."""
    batcher = ContinuousBatcher(engine(streaming, seed))
    next_index, lock, took = iter(range(groups)), threading.Lock(), []

    def worker() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            began = time.perf_counter()
            batcher.submit(*request(index))
            with lock:
                took.append(time.perf_counter() - began)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    batcher.close()
    return groups / elapsed, statistics.mean(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=32, help="groups in the step")
    parser.add_argument("--concurrency", type=int, default=16, help="groups in flight when the replica is kept full")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"one replica, {args.groups} groups of 8 rows; decode time lognormal median 40 ms, sigma 0.5, "
          "10% of groups 8x longer")
    print(f"a step dispatched at once ({args.groups} groups)")
    print(f"  {'mode':<10} {'first s':>8} {'mean s':>8} {'last s':>8}")
    firsts = {}
    for mode, streaming in (("waves", False), ("streaming", True)):
        answered = one_step(streaming, args.groups, args.seed)
        firsts[mode] = answered[0]
        print(f"  {mode:<10} {answered[0]:>8.3f} {statistics.mean(answered):>8.3f} {answered[-1]:>8.3f}")
    ratio = firsts["waves"] / firsts["streaming"]
    print(f"  first group back {ratio:.1f}x sooner streaming (goal >= 1.5x): {'ok' if ratio >= 1.5 else 'MISSED'}")

    total = 4 * args.groups
    print(f"a replica kept full ({args.concurrency} groups in flight, {total} groups)")
    print(f"  {'mode':<10} {'groups/s':>9} {'mean s':>8}")
    rates = {}
    for mode, streaming in (("waves", False), ("streaming", True)):
        rates[mode], mean = kept_full(streaming, total, args.concurrency, args.seed)
        print(f"  {mode:<10} {rates[mode]:>9.1f} {mean:>8.3f}")
    print(f"  throughput {rates['streaming'] / rates['waves']:.1f}x streaming")


if __name__ == "__main__":
    main()
