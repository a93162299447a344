"""Weights (and optimizer state) in host memory while an engine is idle.

Two ways an engine gives its GPU memory back, shared by the torch, fsdp and
megatron engines:

- a trainer sleeps while the controller runs the stages it takes turns with
  (``Offloaded``: its module and optimizer state to host memory and back);
- a logprob engine that offloads keeps its weights in host memory between
  scoring calls (``on_device_for_call``): it scores whenever a group
  arrives, beside whatever else runs on its GPUs, so nothing could put it to
  sleep for a turn; it holds its weights on the GPU only while it scores.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class Offloaded:
    """A module's parameters (FSDP re-points its shards on ``module.to``) and
    an optimizer's state tensors moved to host memory and back. Copies are
    exact, so ``wake`` restores every value bit for bit."""

    def __init__(self):
        self.home: torch.device | None = None
        self.asleep = False

    def sleep(self, module: torch.nn.Module, optimizer=None) -> None:
        self.home = next(module.parameters()).device
        if self.home.type != "cpu":
            self._move(module, optimizer, torch.device("cpu"))
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self, module: torch.nn.Module, optimizer=None) -> None:
        if not self.asleep:
            return
        if self.home.type != "cpu":
            self._move(module, optimizer, self.home)
        self.asleep = False

    @staticmethod
    def _move(module, optimizer, device: torch.device) -> None:
        module.to(device)
        for param_state in (optimizer.state.values() if optimizer is not None else ()):
            for key, value in param_state.items():
                if torch.is_tensor(value) and value.dim() > 0:  # AdamW's `step` stays where it is
                    param_state[key] = value.to(device)


@contextmanager
def on_device_for_call(engine):
    """The weights of an engine with ``offload`` set on its device for one
    call, back in host memory after it (even when the call raises); a plain
    call otherwise. ``engine`` has ``offload``, ``wake`` and ``sleep``."""
    if not getattr(engine, "offload", False):
        yield
        return
    engine.wake()
    try:
        yield
    finally:
        engine.sleep()
