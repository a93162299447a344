"""A floor under vLLM's decoding pace, for run tests that must be generation-bound.

Imported by vLLM's worker (a ``logits_processors`` entry): each sampling
step first sleeps ``RLDSL_TEST_VLLM_STEP_SECONDS``, then passes the logits
on unchanged, so the sampled tokens and their logprobs are vLLM's own. A
sleep takes no CPU: the floor holds however busy the machine is, where a
pace that rests on compute (the tiny model decodes faster than the trainer
trains on it) flips with the load beside the run.
"""

from __future__ import annotations

import os
import time

from vllm.v1.sample.logits_processor import LogitsProcessor

STEP_SECONDS_ENV = "RLDSL_TEST_VLLM_STEP_SECONDS"


class PacedDecoding(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.seconds = float(os.environ.get(STEP_SECONDS_ENV, "0.02"))

    def is_argmax_invariant(self) -> bool:
        return False  # so vLLM applies it to every batch, greedy or sampled

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits):
        time.sleep(self.seconds)
        return logits
