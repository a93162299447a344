"""Run megatron-core 0.16.1 on a CPU with gloo: FOR TESTS ONLY.

megatron-core assumes CUDA in a handful of places that have nothing to do
with the maths under test (the split-step gradient, the weight layout). On a
CPU-only torch those places raise. ``megatron_on_cpu()`` patches exactly
these places for the duration of a ``with`` block and restores every
original on exit. Production code never imports this module; on a GPU none
of it is needed.

Each patch, and why:

0. ``torch.cuda.is_available`` returns False, so the tests run on the CPU
   on any machine, a GPU machine included (their numbers must not depend
   on where they run; tests/test_megatron_gpu.py covers the GPU).
1. ``torch.cuda.current_device`` returns ``"cpu"``. Rotary embeddings, the
   DDP wrapper and the fp32 optimizer pass ``torch.cuda.current_device()`` as
   a device; ``"cpu"`` is a valid device there, and torch's own function
   raises on a CPU build.
   ``torch.cuda.synchronize`` does nothing: pipeline-parallel send/receive
   calls it around gloo transfers, which are already synchronous on a CPU.
   ``Tensor.cuda`` returns the tensor itself: with tied embeddings and
   pipeline parallelism the first and last stages move the shared weight
   "to the GPU" before all-reducing it over the embedding group.
2. The module-level ``torch`` of the megatron modules below is swapped for a
   proxy whose tensor factories map ``device="cuda"`` to the CPU. These
   modules allocate small bookkeeping tensors with a literal
   ``device="cuda"``: the schedules' token counter, the fp32 optimizer's
   loss scale, the grad-norm buffers of ``clip_grads`` and the fallback
   multi-tensor l2 norm of ``megatron.core.utils`` (used without Apex).
   Everything else about ``torch`` is passed through.
3. ``CudaRNGStatesTracker.add`` / ``.fork`` keep CPU generator states. The
   tracker snapshots CUDA RNG states so dropout differs across tensor-parallel
   ranks; on a CPU the equivalent is the CPU generator (the tests use no
   dropout, so this only has to not raise and to restore the state).
4. ``clip_grad_by_total_norm_fp32`` is replaced by the same clipping without
   its assertion that every gradient is a ``torch.cuda.FloatTensor``.
5. ``tensor_parallel.random``'s ``_get_cuda_rng_state`` returns None and
   ``_set_cuda_rng_state`` does nothing: the trainer's layer recompute
   (``tensor_parallel.checkpoint``) snapshots the CPU, CUDA and tracker RNG
   states around each recomputed layer; the CPU state and the tracker's
   (CPU states, patch 3) are saved and restored as on a GPU, and there is no
   CUDA generator to save.

6. ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` are stand-ins that
   do nothing: the MoE ``alltoall`` token dispatcher makes a side stream for
   its device-to-host copies of the split sizes and synchronises on it.
7. The dispatcher's ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` returns
   a CPU tensor's numpy array too: it converts only CUDA tensors, and
   ``all_to_all_single`` takes split sizes as a list, not a tensor.

Not covered (they fail on a CPU even with these patches): bf16/fp16 mixed
precision optimizers, the distributed optimizer and Transformer Engine
layers.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

import torch

# Modules that allocate with a literal ``device="cuda"`` on the paths the tests use
# (each one is needed: without it a test of tests/test_megatron_engine.py fails).
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.utils",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")


def _cpu_if_cuda(device):
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return "cpu"
    return device


class _CpuTorch:
    """``torch`` with ``device="cuda"`` in tensor factories read as the CPU."""

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name not in _FACTORIES:
            return value

        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_if_cuda(kwargs["device"])
            return value(*args, **kwargs)

        return factory


def _rng_add(self, name, seed):
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self._is_initialized = True
    self.seeds_.add(seed)
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def _rng_fork(self, name="model-parallel-rng"):
    outer = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)


def _no_cuda_rng_state(*args, **kwargs):
    return None


class _Stream:
    """What the MoE dispatcher asks of a CUDA stream, doing nothing (CPU work is synchronous)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return self

    def synchronize(self):
        pass


_STREAM = _Stream()


def _split_sizes_on_cpu(original):
    def to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return to_cpu


def _clip_grad_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attribute) for p in parameters if getattr(p, attribute, None) is not None]
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)


class _Patches:
    def __init__(self):
        self._undo: list[tuple[object, str, object]] = []

    def set(self, owner, name: str, value) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            setattr(owner, name, original)


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Apply the patches above; restore every original on exit."""
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.moe import token_dispatcher

    patches = _Patches()
    try:
        patches.set(torch.cuda, "is_available", lambda: False)
        patches.set(torch.cuda, "current_device", lambda: "cpu")
        patches.set(torch.cuda, "synchronize", lambda *args, **kwargs: None)
        patches.set(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
        cpu_torch = _CpuTorch()
        for module_name in _MODULES_WITH_CUDA_LITERALS:
            patches.set(importlib.import_module(module_name), "torch", cpu_torch)
        patches.set(random.CudaRNGStatesTracker, "add", _rng_add)
        patches.set(random.CudaRNGStatesTracker, "fork", _rng_fork)
        patches.set(random, "_get_cuda_rng_state", _no_cuda_rng_state)
        patches.set(random, "_set_cuda_rng_state", _no_cuda_rng_state)
        for module in (clip_grads, optimizer):  # optimizer.py imported the function by name
            patches.set(module, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm)
        patches.set(torch.cuda, "Stream", _Stream)
        patches.set(torch.cuda, "current_stream", lambda *args, **kwargs: _STREAM)
        patches.set(torch.cuda, "stream", lambda *args, **kwargs: contextlib.nullcontext())
        patches.set(token_dispatcher, "maybe_move_tensor_to_cpu",
                    _split_sizes_on_cpu(token_dispatcher.maybe_move_tensor_to_cpu))
        yield
    finally:
        patches.undo()


_installed: list = []  # the open context, kept alive: collecting it would undo the patches


def install() -> None:
    """The patches for the rest of this process: the test suite's end-to-end
    run sets ``RLDSL_WORKER_SETUP`` to this function, so every Ray worker
    of the run applies them before it builds an engine."""
    if not _installed:
        context = megatron_on_cpu()
        context.__enter__()
        _installed.append(context)
