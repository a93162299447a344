"""Weight sync: one version from a trainer process to a generator process,
through Ray's object store and rank to rank over a gloo group, side by side.

For each model size, a "trainer" actor yields the weights in buckets of the
given size (made one at a time, as a sharded trainer's gather does) and a
"generator" actor applies them into a model it already holds:

- object store: the trainer ``ray.put``s every bucket (the host bucket
  cache), the generator ``ray.get``s them all and applies each (today's
  path for vLLM / SGLang and for CPU runs);
- collective: ``rldsl.runtime.transport`` streams the buckets (gloo on a
  CPU; NCCL where the tensors are on GPUs).

Printed per transport and size: seconds per version (median of --reps),
GB/s, and how much each side's peak resident memory grew over the pushes
(the model itself excluded; each transport runs in processes of its own). The projection uses the measured bandwidth.

With ``--lora-rank R``, the sizes measured are also a LoRA run's: the bytes
of rank-R adapters on q_proj and v_proj (`lora_rank`, the default targets)
of Llama-3.1-8B and Llama-3.1-70B in bf16 (``lora_push_bytes``: the
memory model's count on their published shapes), measured side by side
with the sizes above, and each set against the whole model's projected push.

    python bench/weight_sync.py [--sizes-mib 1,64,512] [--bucket-mib 32] [--reps 3] [--lora-rank 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

MIB = 2**20
ENV = {"MALLOC_MMAP_THRESHOLD_": str(MIB)}  # freed buckets go back to the OS: peak RSS measures what is held


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Trainer:
    """Holds a model of ``size`` bytes; exports it in buckets."""

    def __init__(self, size: int, bucket: int) -> None:
        import torch

        self.tensors = [torch.randn(bucket // 4) for _ in range(max(1, size // bucket))]
        self.group = None

    def buckets(self):
        for index, tensor in enumerate(self.tensors):
            yield {f"layer{index}.weight": tensor.clone()}  # a gather makes a new tensor per bucket

    def join(self, store_path: str, name: str) -> None:
        import torch.distributed as dist

        from rldsl.runtime.transport.group import form_group

        self.group = form_group(dist.FileStore(store_path, 2), name, 0, 2)

    def export_to_store(self) -> tuple[list, int]:
        import ray

        before = peak_rss()
        refs = [ray.put(bucket) for bucket in self.buckets()]
        return refs, peak_rss() - before

    def stream(self, version: int) -> int:
        from rldsl.runtime.transport.stream import send_buckets

        before = peak_rss()
        send_buckets(self.group, self.buckets(), version)
        return peak_rss() - before


class Generator:
    """Holds the same model shape; applies pushed buckets in place."""

    def __init__(self, size: int, bucket: int) -> None:
        import torch

        self.tensors = {f"layer{i}.weight": torch.zeros(bucket // 4) for i in range(max(1, size // bucket))}
        self.group = None

    def join(self, store_path: str, name: str) -> None:
        import torch.distributed as dist

        from rldsl.runtime.transport.group import form_group

        self.group = form_group(dist.FileStore(store_path, 2), name, 1, 2)

    def _apply(self, bucket) -> None:
        for name, tensor in bucket.items():
            self.tensors[name].copy_(tensor)

    def receive_from_store(self, refs: list) -> int:
        import ray

        before = peak_rss()
        for bucket in ray.get(refs):  # the receiver fetches the version, then applies it
            self._apply(bucket)
        return peak_rss() - before

    def receive_stream(self, version: int) -> int:
        from rldsl.runtime.transport.stream import receive_buckets

        before = peak_rss()
        for bucket, _ in receive_buckets(self.group, version):
            self._apply(bucket)
        return peak_rss() - before

    def checksum(self) -> float:
        return float(sum(t.sum() for t in self.tensors.values()))


def measure(size: int, bucket: int, reps: int) -> dict:
    """Each transport gets a trainer and a generator process of its own (a
    process's peak memory only grows, so one transport must not hide the
    other's); the two alternate, so load on the machine hits both alike."""
    import ray

    options = {"num_cpus": 1, "runtime_env": {"env_vars": ENV}}
    pairs = {name: (ray.remote(Trainer).options(**options).remote(size, bucket),
                    ray.remote(Generator).options(**options).remote(size, bucket))
             for name in ("object store", "collective")}
    trainer, generator = pairs["collective"]
    store = os.path.join(tempfile.mkdtemp(prefix="weight-sync-"), "store")
    ray.get([trainer.join.remote(store, f"bench{size}"), generator.join.remote(store, f"bench{size}")])
    rows = {name: [] for name in pairs}
    for version in range(reps):
        trainer, generator = pairs["object store"]
        started = time.perf_counter()
        refs, sent_growth = ray.get(trainer.export_to_store.remote())
        received_growth = ray.get(generator.receive_from_store.remote(refs))
        rows["object store"].append((time.perf_counter() - started, sent_growth, received_growth))
        del refs
        trainer, generator = pairs["collective"]
        started = time.perf_counter()
        sent_growth, received_growth = ray.get([trainer.stream.remote(version),
                                                generator.receive_stream.remote(version)])
        rows["collective"].append((time.perf_counter() - started, sent_growth, received_growth))
    for actor in (a for pair in pairs.values() for a in pair):
        ray.kill(actor)
    return {name: (statistics.median(r[0] for r in runs), sum(r[1] for r in runs), sum(r[2] for r in runs))
            for name, runs in rows.items()}


LLAMA3 = {"8B": 8.03e9, "70B": 70.6e9}  # parameters: their shapes are the memory model's reference shapes


def lora_push_bytes(params: float, rank: int) -> int:
    """bf16 bytes of rank-``rank`` adapters on q_proj and v_proj (the default targets), as the memory
    model counts them."""
    from rldsl.compiler import memory_model

    return 2 * memory_model.lora_params(memory_model.REFERENCE_SHAPES[params], rank, ["q_proj", "v_proj"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="1,64,512")
    parser.add_argument("--bucket-mib", type=float, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=0, help="also measure LoRA adapters' pushes")
    args = parser.parse_args()
    adapters = {label: lora_push_bytes(params, args.lora_rank) for label, params in LLAMA3.items()} \
        if args.lora_rank else {}
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    bucket = int(args.bucket_mib * MIB)
    print(f"one version, trainer process -> generator process, buckets of {args.bucket_mib:g} MiB, "
          f"median of {args.reps}")
    print(f"{'model':>9}  {'transport':<13} {'s/version':>10} {'GB/s':>7}  {'sender +RSS':>12}  {'receiver +RSS':>14}")
    best: dict[str, float] = {}
    measured: dict[float, dict] = {}
    sizes = [float(s) for s in args.sizes_mib.split(",")] + [nbytes / MIB for nbytes in adapters.values()]
    for size_mib in sizes:
        size = int(size_mib * MIB)
        measured[size_mib] = measure(size, min(bucket, size), args.reps)
        for name, (seconds, sent, received) in measured[size_mib].items():
            rate = size / seconds / 1e9
            best[name] = max(best.get(name, 0.0), rate)
            print(f"{size_mib:>6g}MiB  {name:<13} {seconds:>10.3f} {rate:>7.2f}  {sent / MIB:>9.0f}MiB  "
                  f"{received / MIB:>11.0f}MiB")
    print("projection from the best measured rate (bf16 weights; one receiver; this machine's loopback):")
    for params, label in ((7e9, "7B"), (70e9, "70B")):
        print(f"  {label}: " + ", ".join(f"{name} {params * 2 / 1e9 / rate:.0f} s" for name, rate in best.items()))
    for label, nbytes in adapters.items():
        params = LLAMA3[label]
        seconds = {name: row[0] for name, row in measured[nbytes / MIB].items()}
        print(f"LoRA rank {args.lora_rank} on q_proj, v_proj of Llama-3.1-{label}: {nbytes / MIB:.1f} MiB per push "
              f"against {params * 2 / 2**30:.0f} GiB for the whole model ({params * 2 / nbytes:.0f}x less); "
              "measured: " + ", ".join(f"{name} {s:.3f} s" for name, s in seconds.items()) + "; whole model "
              "projected: " + ", ".join(f"{name} {params * 2 / 1e9 / rate:.0f} s" for name, rate in best.items()))
    ray.shutdown()


if __name__ == "__main__":
    main()
