"""A floor under vLLM's decoding pace, for run tests that must be generation-bound.

Imported by vLLM's worker (a ``logits_processors`` entry): each sampling
step first sleeps ``STEP_SECONDS``, then passes the logits on unchanged, so the sampled tokens and their logprobs are vLLM's own. A
sleep takes no CPU: the floor holds however busy the machine is, where a
pace that rests on compute (the tiny model decodes faster than the trainer
trains on it) flips with the load beside the run.
"""

from __future__ import annotations

import time

from vllm.v1.sample.logits_processor import LogitsProcessor

STEP_SECONDS = 0.05  # a constant: the worker runs in a Ray actor, whose environment the test does not set


class PacedDecoding(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return False  # so vLLM applies it to every batch, greedy or sampled

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits):
        time.sleep(STEP_SECONDS)
        return logits
