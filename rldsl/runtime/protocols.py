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
- ``loss_mask``     int64 [n, Lr]  written by a generate stage with an
  environment: 1 on the model's tokens, 0 on the environment's (which the
  response holds between turns and no trainer trains); absent: all 1
- ``episode_reward`` float32 [n], ``episode_status`` int64 [n], ``turns``
  int64 [n]: an environment episode's summed reward, how it ended
  (``rldsl.runtime.environments.EpisodeStatus``) and its model turns

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
FIELD_TOKEN_VERSIONS = "token_versions"  # [rows, T]: the version that drew each token (update = interrupt)
FIELD_REWARD = "reward"
FIELD_ADVANTAGE = "advantage"
FIELD_LOSS_MASK = "loss_mask"
FIELD_EPISODE_REWARD = "episode_reward"
FIELD_EPISODE_STATUS = "episode_status"
FIELD_TURNS = "turns"
FIELD_TOOL_CALLS = "tool_calls"  # an episode's tool calls, and those that failed
FIELD_TOOL_ERRORS = "tool_errors"
FIELD_TURN_REWARDS = "turn_rewards"  # [rows, max_turns]: the environment's reward at each model turn (NaN: none)
FIELD_CONTEXT_FULL = "context_full"  # 1 where an episode ended because another turn would pass the context


def trained_tokens(batch: Batch):
    """The tokens the loss counts: the response mask, times the loss mask
    where an environment wrote one (its own tokens are context, never trained)."""
    mask = batch[FIELD_RESPONSE_MASK]
    loss_mask = batch.get(FIELD_LOSS_MASK)
    return mask if loss_mask is None else mask * loss_mask.to(device=mask.device, dtype=mask.dtype)


def sample_token_counts(batch: Batch) -> tuple[int, ...]:
    """Each row's trained tokens (``trained_tokens`` summed over the row)."""
    return tuple(int(n) for n in trained_tokens(batch).sum(dim=1).tolist())


def mask_truncated(batch: Batch, max_new_tokens: int, end_ids) -> int:
    """Write a ``loss_mask`` that leaves out every response cut at
    ``max_new_tokens`` before it ended (its last token no EOS or stop token):
    `truncated = mask` (DAPO's overlong filtering, ROLL's ``max_len_mask``).
    The rows keep their rewards, so their groups' advantages are unchanged.
    Returns how many rows were masked."""
    import torch  # here, not at import: check and plan read this module

    mask = batch[FIELD_RESPONSE_MASK]
    lengths = mask.sum(dim=1)
    last = batch[FIELD_RESPONSE_IDS].gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    truncated = (lengths >= max_new_tokens) & ~torch.isin(last, torch.tensor(list(end_ids), dtype=last.dtype))
    batch[FIELD_LOSS_MASK] = mask * (~truncated).to(mask.dtype)[:, None]
    return int(truncated.sum())


# Prompt.meta key: the prompt's token count before `long_prompts = truncate` cut it to `max_prompt_tokens`
PROMPT_TRUNCATED = "prompt_truncated"


def mask_truncated_prompts(batch: Batch, prompts: list[Prompt], samples_per_prompt: int) -> int:
    """Write a ``loss_mask`` that leaves every sample of a truncated prompt
    (rows prompt-major) out of the loss, as NeMo RL's ``loss_multiplier =
    0``, and keeps a mask already written. The rows keep their rewards.
    Returns the rows masked."""
    cut = [i for i, prompt in enumerate(prompts) if (prompt.meta or {}).get(PROMPT_TRUNCATED)]
    mask = trained_tokens(batch).clone()
    for group in cut:
        mask[group * samples_per_prompt:(group + 1) * samples_per_prompt] = 0
    batch[FIELD_LOSS_MASK] = mask
    return len(cut) * samples_per_prompt


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
    # The prompt as tokens, read as they are (a conversation's next turn: the
    # tokens so far exactly as sampled); None: the engine encodes ``text``.
    ids: tuple[int, ...] | None = None

    def tokens(self, tokenizer) -> list[int]:
        """What an engine reads: ``ids`` when given, else ``text`` encoded with BOS."""
        return list(self.ids) if self.ids is not None else tokenizer.encode(self.text, add_bos=True)


@dataclass(frozen=True)
class Generated:
    """What a generator replica reports for one prompt group: the weight
    version its rows were generated with (with ``update = interrupt`` the
    oldest: a group's lag is its oldest token's) and its response tokens (the
    trainer's ranks are balanced by them). ``token_versions``: when weights
    changed mid-group, each sample's (in key order) tokens' versions as
    ``(version, tokens)`` runs in order; empty when every token is
    ``version``'s.
    ``sample_tokens``: each sample's trained tokens (``trained_tokens``), in
    key order, which `normalize = batch_tokens` weighs its samples by."""

    version: int
    tokens: int = 0
    token_versions: tuple[tuple[tuple[int, int], ...], ...] = ()
    sample_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class RewardFailure:
    """A sample whose reward cannot be used, in place of its float: ``reason``
    is the ledger's drop reason (``reward_raised``, ``reward_timeout``,
    ``reward_invalid``), ``detail`` what happened, for the run's messages."""

    reason: str
    detail: str = ""


class ComponentReward(float):
    """A reward stage's weighted sum of named components: the float that is
    trained on, with each component's own value in ``parts`` (the step's
    ``reward/<name>`` metrics), and ``stats``: what else is known of the
    sample that is no reward (an episode's turns and tool calls: the step's
    ``episode/<name>`` metrics)."""

    def __new__(cls, total: float, parts: dict[str, float], stats: dict[str, float] | None = None):
        reward = super().__new__(cls, total)
        reward.parts = dict(parts)
        reward.stats = dict(stats or {})
        return reward

    def __reduce__(self):
        return ComponentReward, (float(self), self.parts, self.stats)


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
