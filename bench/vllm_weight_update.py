"""One weight version into a running vLLM engine, in place, against starting
the engine on the same weights: what a push costs instead of a restart.

A random Llama of about the given size (fp32, head_dim 64) is saved as a
Hugging Face directory; a ``VLLMGenerator`` (vLLM's CPU build on a machine
without a GPU) starts on it; then each version is pushed bucket by bucket
through ``update_weights`` (shared memory, vLLM's layerwise reload:
docs/engines.md). Printed per size: seconds to start the engine, seconds per
version (median of --reps), GB/s, and the peak growth of the resident
memory of this process and vLLM's engine processes during a push, over
what they held before it (the pushed buckets included). The trainer-to-actor hop is bench/weight_sync.py's.

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
    import torch

    from rldsl.models.hf import load_hf_model
    from rldsl.runtime.engines.torch.common import tensor_buckets
    from rldsl.runtime.engines.vllm import VLLMGenerator, VLLMOptions

    directory = llama_of(size, Path(tempfile.mkdtemp(prefix="vllm-update-")) / "model")
    state = load_hf_model(str(directory)).module.state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    started = time.perf_counter()
    options = VLLMOptions(kv_cache=64 * MIB, dtype="fp32", max_model_len=128, sleep=False)
    engine = VLLMGenerator.from_path(str(directory), options, seed=0, max_new_tokens=4)
    start_s = time.perf_counter() - started
    me = psutil.Process()
    processes = [me, *me.children(recursive=True)]
    seconds, growth = [], 0
    for version in range(1, reps + 1):
        with torch.no_grad():  # the version, in buckets, before the clock and the memory baseline start
            buckets = list(tensor_buckets(((n, t * 1.01) for n, t in state.items()), bucket))
        before = resident(processes)
        sampler = PeakSampler(processes)
        started = time.perf_counter()
        for index, items in enumerate(buckets):
            engine.update_weights(items, version, index == len(buckets) - 1)
        seconds.append(time.perf_counter() - started)
        growth = max(growth, sampler.stop() - before)
        assert engine.llm.current_version() == version
        del buckets
    engine.llm.shutdown()
    return {"bytes": model_bytes, "start_s": start_s, "version_s": statistics.median(seconds), "growth": growth}


class PeakSampler:
    """The processes' summed resident memory, sampled every 5 ms until ``stop``: its peak."""

    def __init__(self, processes) -> None:
        import threading

        self.processes, self.peak, self.done = processes, resident(processes), threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, resident(self.processes))

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, resident(self.processes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="16,128")
    parser.add_argument("--bucket-mib", type=float, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    bucket = int(args.bucket_mib * MIB)
    print(f"one version into a running vLLM, buckets of {args.bucket_mib:g} MiB, median of {args.reps}")
    print(f"{'model':>9}  {'engine start s':>14}  {'s/version':>10} {'GB/s':>6}  {'push peak +RSS':>15}")
    for size_mib in (float(s) for s in args.sizes_mib.split(",")):
        row = measure(int(size_mib * MIB), bucket, args.reps)
        rate = row["bytes"] / row["version_s"] / 1e9
        print(f"{row['bytes'] / MIB:>6.0f}MiB  {row['start_s']:>14.1f}  {row['version_s']:>10.3f} {rate:>6.2f}  "
              f"{row['growth'] / MIB:>12.0f}MiB")


if __name__ == "__main__":
    main()
