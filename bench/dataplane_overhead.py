"""What TransferQueueDataPlane adds on top of raw TransferQueue.

For each batch shape, one put and one get of an int64 token field, timed
through raw ``tq.kv_batch_put`` / ``tq.kv_batch_get`` (which returns a jagged
nested tensor) and through ``TransferQueueDataPlane.put`` / ``get`` (which
returns a dense tensor). Raw and ours alternate within each repetition so
load on the machine hits both alike. The "ragged" case reads back rows
written by two puts of different widths, so ours must pad.

    python bench/dataplane_overhead.py [--reps 15] [--storage-units 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

SHAPES = [(64, 256), (256, 2048), (1024, 8192)]
FIELD = "response_ids"


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1e3


def batch_halves(rows: int, width: int, ragged: bool):
    """One batch, or two halves padded to different widths when ragged."""
    import torch

    tokens = torch.randint(1, 32_000, (rows, width), dtype=torch.int64)
    if not ragged:
        return [tokens]
    return [tokens[: rows // 2], tokens[rows // 2 :, : width // 2]]


def raw_round(tq, keys, parts, partition) -> tuple[float, float]:
    from tensordict import TensorDict

    put_ms, start = 0.0, 0
    for part in parts:
        part_keys = keys[start : start + len(part)]
        start += len(part)
        put_ms += timed(
            lambda: tq.kv_batch_put(
                keys=part_keys, partition_id=partition, fields=TensorDict({FIELD: part}, batch_size=[len(part)])
            )
        )
    get_ms = timed(lambda: tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=[FIELD]))
    tq.kv_clear(keys=keys, partition_id=partition)
    return put_ms, get_ms


def plane_round(plane, keys, parts, partition) -> tuple[float, float]:
    put_ms, start = 0.0, 0
    for part in parts:
        part_keys = keys[start : start + len(part)]
        start += len(part)
        put_ms += timed(lambda: plane.put(part_keys, partition, {FIELD: part}))
    get_ms = timed(lambda: plane.get(keys, partition, [FIELD]))
    plane.clear(keys, partition)
    return put_ms, get_ms


def measure(tq, plane, rows: int, width: int, ragged: bool, reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in ("raw_put", "raw_get", "our_put", "our_get")}
    for rep in range(reps + 2):  # two warm-up rounds are dropped
        parts = batch_halves(rows, width, ragged)
        keys = [f"bench/{rows}x{width}/{rep}/{i}" for i in range(rows)]
        raw = raw_round(tq, keys, parts, "bench-raw")
        ours = plane_round(plane, keys, parts, "bench-ours")
        if rep >= 2:
            for name, value in zip(("raw_put", "raw_get", "our_put", "our_get"), raw + ours):
                times[name].append(value)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--storage-units", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    from rldsl.runtime.dataplane import TransferQueueDataPlane
    from rldsl.runtime.ray_lowering.cluster import ray_session

    with ray_session(namespace="rldsl-bench") as session:
        plane = TransferQueueDataPlane(storage_units=args.storage_units)
        session.add_cleanup(plane.close)
        import transfer_queue as tq

        print(f"median of {args.reps} repetitions, ms (int64 tokens; {args.storage_units} storage unit(s))")
        columns = ["raw put", "raw get", "raw", "our put", "our get", "ours"]
        cells = [f"{name:>8}" for name in columns]
        header = f"{'batch':>16} {'MB':>6} | {' '.join(cells[:3])} | {' '.join(cells[3:])} | ratio"
        print(header + "\n" + "-" * len(header))
        cases = [(rows, width, False) for rows, width in SHAPES] + [(256, 2048, True)]
        for rows, width, ragged in cases:
            times = measure(tq, plane, rows, width, ragged, args.reps)
            median = {name: statistics.median(values) for name, values in times.items()}
            raw, ours = median["raw_put"] + median["raw_get"], median["our_put"] + median["our_get"]
            label = f"{rows}x{width}" + (" ragged" if ragged else "")
            megabytes = rows * width * 8 / 2**20 * (0.75 if ragged else 1)
            print(
                f"{label:>16} {megabytes:6.1f} | {median['raw_put']:8.2f} {median['raw_get']:8.2f} {raw:8.2f} | "
                f"{median['our_put']:8.2f} {median['our_get']:8.2f} {ours:8.2f} | {ours / raw:5.2f}x"
            )


if __name__ == "__main__":
    main()
