"""One weight version into a running vLLM engine, in place, two ways, against
starting the engine on the same weights: what a push costs instead of a
restart.

A random Llama of about the given size (fp32, head_dim 64) is saved as a
Hugging Face directory; a ``VLLMGenerator`` (vLLM's CPU build on a machine
without a GPU) starts on it; then each version is streamed bucket by bucket
from this process as the trainer's rank 0 of a weight group (gloo), side by
side on the same engine, two ways:

- ``via actor``: the group's other rank is the replica's actor (a thread
  here), which gathers the version and hands it to vLLM's worker through
  shared memory (``update_weights``, vllm_worker.py), as every collective
  push did before vLLM's workers joined the group, and as a push through
  the object store still arrives after its own hop;
- ``into workers``: vLLM's worker is the group's other rank and loads each
  bucket as it arrives (``receive_stream``, engines/vllm_receiver.py).

Printed per size and way: seconds to start the engine, seconds per version
(median of --reps), GB/s, and the peak growth of the resident memory during
a push over what was held before it (the version already built), of this
process (the trainer's side and the actor's) and of vLLM's engine
processes. Files in shared memory are not resident memory of the process
that writes them: the ``via actor`` way holds each bucket once more there
while its worker reads it.

    python bench/vllm_weight_update.py [--sizes-mib 16,128] [--bucket-mib 32] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

MIB = 2**20


def llama_of(size: int, directory: Path) -> Path:
    """A random Llama of about ``size`` bytes in fp32 with the builtin character tokenizer."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.hf_tiny import save_char_llama

    hidden = 512
    per_layer = 4 * (4 * hidden * hidden + 3 * hidden * 2 * hidden)  # attention + MLP (2x wide), fp32 bytes
    layers = max(1, round(size / per_layer))
    return save_char_llama(directory, seed=0, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                           num_hidden_layers=layers, max_position_embeddings=128)


def resident(processes) -> int:
    return sum(p.memory_info().rss for p in processes if p.is_running())


def measure(size: int, bucket: int, reps: int) -> dict:
    import psutil

    from rldsl.models.hf import load_hf_model
    from rldsl.runtime.engines.vllm import VLLMGenerator, VLLMOptions

    directory = llama_of(size, Path(tempfile.mkdtemp(prefix="vllm-update-")) / "model")
    state = load_hf_model(str(directory)).module.state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    started = time.perf_counter()
    options = VLLMOptions(kv_cache=64 * MIB, dtype="fp32", max_model_len=128, sleep=False)
    engine = VLLMGenerator.from_path(str(directory), options, seed=0, max_new_tokens=4)
    start_s = time.perf_counter() - started
    me = psutil.Process()
    vllm_processes = me.children(recursive=True)
    ways = {"via actor": _via_actor(engine, directory.parent), "into workers": _into_workers(engine, directory.parent)}
    rows, version = {}, 0
    for way, push in ways.items():
        seconds, growth = [], {"this": 0, "vllm": 0}
        for _ in range(reps):
            version += 1
            buckets = _buckets(state, bucket, version)  # before the clock and the memory baseline start
            samplers = {"this": PeakSampler([me]), "vllm": PeakSampler(vllm_processes)}
            started = time.perf_counter()
            push(buckets, version)
            seconds.append(time.perf_counter() - started)
            for side, sampler in samplers.items():
                growth[side] = max(growth[side], sampler.growth())
            assert engine.llm.current_version() == version
            del buckets
        rows[way] = {"version_s": statistics.median(seconds), **growth}
    engine.llm.shutdown()
    return {"bytes": model_bytes, "start_s": start_s, "ways": rows}


def _buckets(state: dict, bucket: int, version: int) -> list:
    import torch

    from rldsl.runtime.engines.torch.common import tensor_buckets

    with torch.no_grad():
        return list(tensor_buckets(((n, t * (1 + version / 100)) for n, t in state.items()), bucket))


def _group_store(directory: Path, name: str) -> str:
    return f"file://{directory / name}"


def _via_actor(engine, directory: Path):
    """Rank 0 here, rank 1 a thread standing as the replica's actor."""
    import threading

    from rldsl.runtime.transport.group import form_group, open_store
    from rldsl.runtime.transport.stream import receive_buckets, send_buckets

    store, groups = _group_store(directory, "via-actor"), {}

    def join(rank: int) -> None:
        groups[rank] = form_group(open_store(store, 2, rank == 0, 600.0), "via-actor", rank, 2, "cpu", 600.0)

    joining = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in joining:
        thread.start()
    for thread in joining:
        thread.join()

    def actor(version: int) -> None:
        for items, last in receive_buckets(groups[1], version):
            engine.update_weights(items, version, last)

    def push(buckets: list, version: int) -> None:
        receiving = threading.Thread(target=actor, args=(version,))
        receiving.start()
        send_buckets(groups[0], buckets, version)
        receiving.join()
    return push


def _into_workers(engine, directory: Path):
    """Rank 0 here; the engine's workers the other ranks."""
    import threading

    from rldsl.runtime.transport.group import form_group, open_store
    from rldsl.runtime.transport.stream import send_buckets

    size, store = 1 + engine.weight_group_ranks, _group_store(directory, "into-workers")
    called_off = str(directory / "called-off")
    info = {"group": "into-workers", "rank_offset": 1, "size": size, "store": store, "timeout_s": 600.0,
            "called_off_file": called_off}
    joining = threading.Thread(target=engine.join_weight_group, args=(info,))
    joining.start()
    group = form_group(open_store(store, size, True, 600.0), "into-workers", 0, size, "cpu", 600.0)
    joining.join()

    def push(buckets: list, version: int) -> None:
        receiving = threading.Thread(target=engine.receive_stream, args=(version, lambda: False, called_off))
        receiving.start()
        send_buckets(group, buckets, version)
        receiving.join()
    return push


class PeakSampler:
    """The processes' summed resident memory, sampled every 5 ms until ``stop``: its peak."""

    def __init__(self, processes) -> None:
        import threading

        self.processes, self.done = processes, threading.Event()
        self.start = self.peak = resident(processes)
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, resident(self.processes))

    def growth(self) -> int:
        """The peak since the start, over what was resident at the start."""
        self.done.set()
        self.thread.join()
        return max(self.peak, resident(self.processes)) - self.start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="16,128")
    parser.add_argument("--bucket-mib", type=float, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    bucket = int(args.bucket_mib * MIB)
    print(f"one version streamed into a running vLLM, buckets of {args.bucket_mib:g} MiB, median of {args.reps}")
    print(f"{'model':>9}  {'engine start s':>14}  {'way':<12}  {'s/version':>9} {'GB/s':>5}  "
          f"{'+RSS here':>10} {'+RSS vLLM':>10}")
    for size_mib in (float(s) for s in args.sizes_mib.split(",")):
        row = measure(int(size_mib * MIB), bucket, args.reps)
        for way, figures in row["ways"].items():
            rate = row["bytes"] / figures["version_s"] / 1e9
            print(f"{row['bytes'] / MIB:>6.0f}MiB  {row['start_s']:>14.1f}  {way:<12}  {figures['version_s']:>9.3f} "
                  f"{rate:>5.2f}  {figures['this'] / MIB:>7.0f}MiB {figures['vllm'] / MIB:>7.0f}MiB")

if __name__ == "__main__":
    main()
