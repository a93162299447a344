"""The contracts between the controller and the engines.

The controller only moves metadata (sample keys, versions, counts). Engines
compute on batches: a ``Batch`` is a ``dict[str, torch.Tensor]`` whose tensors
share their first dimension (one row per sample). Field names are the
dataflow vocabulary the compiler type-checks (see ``rldsl.compiler.fields``):

- ``prompt_ids``    int64 [n, Lp]  left-padded prompt tokens (pad = 0)
- ``prompt_mask``   int64 [n, Lp]  1 on real prompt tokens
- ``response_ids``  int64 [n, Lr]  right-padded response tokens (pad = 0)
- ``response_mask`` int64 [n, Lr]  1 on real response tokens (EOS included)
- ``behaviour_logprobs`` float32 [n, Lr]  log p(token) under the weights
  that generated it (written by generation, or recomputed by a policy
  logprob stage); 0 where the mask is 0
- ``ref_logprobs``  float32 [n, Lr]  the same under the frozen reference
- ``version``       int64 [n]      weight version that generated the sample
- ``reward``        float32 [n]
- ``advantage``     float32 [n]    group-normalised, set by the controller

Every call is synchronous from the engine's point of view; the runtime wraps
engines in Ray actors and awaits them from the controller's asyncio pumps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Protocol, runtime_checkable

Batch = dict  # dict[str, torch.Tensor]; kept untyped so this module never imports torch
MIB = 1 << 20  # weight buckets and sizes are counted in bytes

FIELD_PROMPT_IDS = "prompt_ids"
FIELD_PROMPT_MASK = "prompt_mask"
FIELD_RESPONSE_IDS = "response_ids"
FIELD_RESPONSE_MASK = "response_mask"
FIELD_BEHAVIOUR_LOGPROBS = "behaviour_logprobs"
FIELD_REF_LOGPROBS = "ref_logprobs"
FIELD_VERSION = "version"
FIELD_REWARD = "reward"
FIELD_ADVANTAGE = "advantage"


def logprob_field(frozen: bool) -> str:
    """The field a logprob stage writes: a frozen reference's, or the policy's behaviour logprobs."""
    return FIELD_REF_LOGPROBS if frozen else FIELD_BEHAVIOUR_LOGPROBS


def version_field(field: str) -> str:
    """Beside a field a stage wrote with weights that change (a policy logprob
    stage's ``behaviour_logprobs``): the weight version of each row."""
    return f"{field}_version"


@dataclass(frozen=True)
class Prompt:
    """One dataset row as the controller hands it to a generator."""

    index: int  # position in the run's prompt stream (unique, monotonic)
    text: str
    answer: str  # the reference answer rewards compare against
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Generated:
    """What a generator replica reports for one prompt group: the weight
    version every row was generated with (a replica swaps weights only
    between batches, so a group never spans two) and its response tokens
    (the trainer's ranks are balanced by them)."""

    version: int
    tokens: int = 0


@dataclass(frozen=True)
class RewardFailure:
    """A sample whose reward cannot be used, in place of its float: ``reason``
    is the ledger's drop reason (``reward_raised``, ``reward_timeout``,
    ``reward_invalid``), ``detail`` what happened, for the run's messages."""

    reason: str
    detail: str = ""


@dataclass
class StepResult:
    """What ``finish_train_step`` reports."""

    version: int  # the trainer's weight version after the optimizer step
    metrics: dict[str, float]


@runtime_checkable
class GenerationEngine(Protocol):
    """Samples responses; owns a copy of the weights tagged with a version."""

    version: int

    def generate(self, prompts: list[Prompt], samples_per_prompt: int, seed: int) -> Batch:
        """Rows ordered prompt-major: prompt 0's samples first. Fills
        prompt_ids, prompt_mask, response_ids, response_mask,
        behaviour_logprobs and version (all rows carry ``self.version``)."""

    def update_weights(self, bucket: Mapping[str, Any], version: int, last: bool) -> None:
        """Copy one bucket of named tensors in place. The new version takes
        effect only when ``last`` is true, so no sample mixes weights."""

    def sleep(self) -> None:
        """Release accelerator memory (colocated placement)."""

    def wake(self) -> None: ...


@runtime_checkable
class LogprobEngine(Protocol):
    def logprobs(self, batch: Batch) -> Any:
        """float32 [n, Lr] log-probabilities of response_ids (0 off-mask)."""


@runtime_checkable
class Trainer(Protocol):
    """The split-step trainer (seeds 000/001).

    One step = one optimizer step. ``begin_train_step`` opens it,
    ``train_microbatch`` accumulates un-normalised loss sums per microbatch,
    ``finish_train_step`` all-reduces the token (or sequence) counts,
    rescales gradients by 1/N, steps the optimizer and bumps the version.
    ``abort_train_step`` drops the open step's gradients; it is idempotent.
    """

    version: int

    def begin_train_step(self, step: int) -> None: ...

    def train_microbatch(self, step: int, batch: Batch) -> dict[str, float]: ...

    def finish_train_step(self, step: int) -> StepResult: ...

    def abort_train_step(self, step: int) -> None: ...

    def weight_buckets(self, bucket_bytes: int) -> Iterator[dict[str, Any]]:
        """The state dict in buckets of at most ``bucket_bytes`` (a single
        tensor larger than that is its own bucket)."""

    # Optional, used when present: ``save_checkpoint(directory)`` (a collective
    # over the trainer's ranks, outside a step) and ``load_checkpoint(directory)
    # -> version`` for checkpoints and resume; ``sleep()`` / ``wake()`` and an
    # ``asleep`` flag to offload between train phases on shared GPUs.


@runtime_checkable
class RewardFunction(Protocol):
    def __call__(self, response: str, answer: str, prompt: str) -> float: ...
