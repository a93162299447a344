"""What every actor process of a run does first, and what it says about itself."""

from __future__ import annotations

import os

# A worker process shares the machine with the others: one thread each keeps
# generation and training truly concurrent on a small CPU.
_THREADS = int(os.environ.get("RLDSL_TORCH_THREADS", "1"))
WORKER_SETUP_ENV = "RLDSL_WORKER_SETUP"
# A concurrency group of its own in every actor of a run: the driver's trace
# drains are answered while the actor is busy in a long call (a trainer step,
# a stalled engine), so a stop never waits on one.
OBSERVE = "observe"
# The trainer's rank-to-rank push streams in a group of its own, so the next
# step's microbatches run while it is in flight (the controller holds back
# whatever changes the weights until it ends: control/exports.py).
PUSH = "push"
METHOD_GROUPS = {"stream_weights": PUSH}


def run_actor(cls):
    """``cls`` as a Ray actor class of the run, with the ``OBSERVE`` group
    (and ``PUSH`` where it streams weights);
    the driver's ``RLDSL_WORKER_SETUP`` reaches it on any Ray (one this run
    joined, or one started before this process set it)."""
    import ray

    groups = {OBSERVE: 1, **{group: 1 for method, group in METHOD_GROUPS.items() if hasattr(cls, method)}}
    options = {"concurrency_groups": groups}
    if worker_setup_env():
        options["runtime_env"] = {"env_vars": worker_setup_env()}
    return ray.remote(**options)(cls)


def worker_setup_env() -> dict[str, str]:
    """The driver's ``RLDSL_WORKER_SETUP`` for a worker's environment ({} when unset): an actor given its own
    ``runtime_env`` must carry it too, since that replaces its class's."""
    return {WORKER_SETUP_ENV: os.environ[WORKER_SETUP_ENV]} if os.environ.get(WORKER_SETUP_ENV) else {}


def setup_worker_process() -> None:
    """Once per worker process: torch threads, then the optional
    ``RLDSL_WORKER_SETUP=module:function`` hook (site patches, or the test
    suite's megatron-on-CPU shim)."""
    import importlib

    import torch

    torch.set_num_threads(_THREADS)
    hook = os.environ.get(WORKER_SETUP_ENV)
    if hook:
        module, _, function = hook.partition(":")
        try:
            setup = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError, ValueError) as err:
            raise RuntimeError(f"{WORKER_SETUP_ENV}={hook!r} names no importable module:function ({err})") from None
        setup()


def where() -> dict:
    """This actor's Ray node and devices, checked against the plan (placement_check.py)."""
    import ray

    context = ray.get_runtime_context()
    return {"node_id": context.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": sorted(int(g) for g in ray.get_gpu_ids()),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
