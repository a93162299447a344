"""``DecodeBatch``: the rows a torch generator decodes together, step by step.

A request is one prompt group (its prompts times ``samples_per_prompt``
rows, one sampling generator). Requests join between decode steps (their
prompts are prefilled, then their KV cache is merged into the running one)
and leave once all their rows have ended, so a long group never holds back a
short one and a new group never waits for the batch to drain.

A request's rows stay in the batch until the whole request ends (a row that
emitted EOS is fed padding), exactly as a one-request decode does: a group
draws the same tokens whatever else is in the batch, up to the float
rounding that padding introduces.

Weights that change mid-decode (``update = interrupt``): ``resume`` prefills
every row in flight again (prompt and tokens so far) under the new weights,
so the next token's distribution and the KV cache are wholly the new
version's, as when a partial rollout is resubmitted. Each step records the
version that computed the distribution its tokens were drawn from and the
log-probability of each drawn token (at the sampling temperature, before
top-p).

Until a request has ``min_new_tokens`` tokens its rows cannot end: EOS and
the stop tokens are never drawn. The recorded log-probabilities stay the
model's own, as the trainer computes them (vLLM's processed logprobs are those
of the distribution without them; its mismatch metrics show the gap).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

from rldsl.runtime.engines.torch.kv_cache import (
    cache_length,
    concat_rows,
    drop_leading_columns,
    left_pad_time,
    select_rows,
)
from rldsl.runtime.engines.torch.common import encode_prompts, logit_divisor, positions_from_mask
from rldsl.runtime.protocols import (
    FIELD_PROMPT_IDS,
    FIELD_PROMPT_MASK,
    FIELD_RESPONSE_IDS,
    FIELD_RESPONSE_MASK,
    Batch,
    Prompt,
)

# (logits [B, V] float32, [(rows, generator)] per request in row order) -> tokens [B]
Sampler = Callable[[torch.Tensor, list[tuple[slice, torch.Generator]]], torch.Tensor]


@dataclass(eq=False)
class DecodeRequest:
    request_id: int
    rows: int
    sampler: torch.Generator
    prompt_ids: torch.Tensor  # CPU, left-padded to this request's own width
    prompt_mask: torch.Tensor
    tokens: list[torch.Tensor] = field(default_factory=list)  # one [rows] tensor per step
    masks: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per step: the weights its tokens were drawn with
    logprobs: list[torch.Tensor] = field(default_factory=list)  # per step: [rows] log p(token) at the temperature

    def batch(self) -> Batch:
        return {
            FIELD_PROMPT_IDS: self.prompt_ids,
            FIELD_PROMPT_MASK: self.prompt_mask,
            FIELD_RESPONSE_IDS: torch.stack(self.tokens, dim=1).cpu(),
            FIELD_RESPONSE_MASK: torch.stack(self.masks, dim=1).cpu(),
        }

    def step_logprobs(self) -> torch.Tensor:
        """[rows, steps] log-probabilities of the drawn tokens, 0 off the mask."""
        return (torch.stack(self.logprobs, dim=1) * torch.stack(self.masks, dim=1)).cpu()

    def generated_so_far(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt and drawn tokens, the keys the running cache holds for these rows."""
        ids = torch.cat([self.prompt_ids, *[token.cpu()[:, None] for token in self.tokens]], dim=1)
        mask = torch.cat([self.prompt_mask, torch.ones(self.rows, len(self.tokens), dtype=torch.long)], dim=1)
        return ids, mask


class DecodeBatch:
    """The running batch: one KV cache for all rows, requests in row order.

    After ``step`` raises, the batch is inconsistent: ``abort()`` it."""

    def __init__(self, model, max_new_tokens: int, sample: Sampler, end_ids: torch.Tensor | None = None,
                 temperature: float = 1.0, min_new_tokens: int = 0):
        self.model = model
        self._logit_divisor = logit_divisor(temperature)
        self.max_new_tokens, self.min_new_tokens = max_new_tokens, min_new_tokens
        self._end_ids = end_ids if end_ids is not None else torch.tensor([model.eos_id])  # EOS and stop tokens
        self.version = 0  # the weights the running cache and logits were computed with
        self._sample = sample
        self._ids = itertools.count()
        self._requests: list[DecodeRequest] = []
        self._ended: dict[int, DecodeRequest] = {}
        self._reset()

    @property
    def rows(self) -> int:
        return sum(request.rows for request in self._requests)

    @torch.no_grad()
    def admit(self, groups: list[tuple[list[Prompt], torch.Generator]], version: int) -> list[int]:
        """Prefill the groups' prompts (one per row) in one forward and add their rows.
        The running batch changes only once the prefill has succeeded."""
        if self._requests and version != self.version:
            raise RuntimeError(f"admitting at version {version} into rows decoded with {self.version}; resume first")
        self.version = version
        prompts = [prompt for group_rows, _ in groups for prompt in group_rows]
        prompt_ids, prompt_mask = encode_prompts(self.model.tokenizer, prompts, self.model.device)
        positions = positions_from_mask(prompt_mask)
        logits, cache = self.model.forward(prompt_ids, prompt_mask, positions)
        admitted, start = [], 0
        for group_rows, sampler in groups:
            rows = slice(start, start + len(group_rows))
            width = int(prompt_mask[rows].sum(dim=1).max())  # this group's own padding, as if decoded alone
            admitted.append(DecodeRequest(next(self._ids), len(group_rows), sampler,
                                          prompt_ids[rows, -width:].cpu(), prompt_mask[rows, -width:].cpu()))
            start = rows.stop
        self._merge(cache, prompt_mask, positions[:, -1:] + 1, logits[:, -1])
        self._requests += admitted
        return [request.request_id for request in admitted]

    @torch.no_grad()
    def step(self) -> list[int]:
        """Draw one token for every row; requests whose rows have all ended
        (EOS or ``max_new_tokens``) leave the batch, the others advance one
        position. Returns the ids of the requests that left."""
        slices = list(self._slices())
        logits = self._logits.float()
        chosen = self._sample(self._held_from_ending(logits, slices),
                              [(rows, request.sampler) for request, rows in slices])
        tokens = torch.where(self._alive, chosen.to(self._alive.device), 0)
        drawn = torch.log_softmax(logits / self._logit_divisor, dim=-1)
        drawn = drawn.gather(1, tokens[:, None].to(logits.device)).squeeze(1)
        for request, rows in slices:
            request.tokens.append(tokens[rows])
            request.masks.append(self._alive[rows].long())
            request.versions.append(self.version)
            request.logprobs.append(drawn[rows])
        self._alive = self._alive & ~torch.isin(tokens, self._end_ids.to(tokens.device))
        alive_rows = self._rows_per_request(self._alive)
        ended = [request for request, alive in zip(self._requests, alive_rows)
                 if alive == 0 or len(request.tokens) == self.max_new_tokens]
        if ended:
            tokens = tokens[self._remove(ended).to(tokens.device)]
        if self._requests:
            self._advance(tokens)
        return [request.request_id for request in ended]

    def _held_from_ending(self, logits: torch.Tensor, slices) -> torch.Tensor:
        """``logits`` with EOS and the stop tokens at -inf on the rows of
        requests that have fewer than ``min_new_tokens`` tokens."""
        young = [rows for request, rows in slices if len(request.tokens) < self.min_new_tokens]
        if not young:
            return logits
        logits = logits.clone()
        end_ids = self._end_ids.to(logits.device)
        for rows in young:
            logits[rows, end_ids] = float("-inf")
        return logits

    def take(self, request_id: int) -> DecodeRequest:
        """An ended request (its rows' fields: ``batch()``, versions and logprobs per step)."""
        return self._ended.pop(request_id)

    @torch.no_grad()
    def resume(self, version: int) -> None:
        """The weights are now ``version``: prefill every row in flight again
        (prompt and tokens so far) so that decoding goes on wholly under them."""
        self.version = version
        if not self._requests:
            return
        parts = [request.generated_so_far() for request in self._requests]
        width = max(ids.shape[1] for ids, _ in parts)
        ids = torch.cat([left_pad_time(ids, width) for ids, _ in parts]).to(self.model.device)
        mask = torch.cat([left_pad_time(mask, width) for _, mask in parts]).to(self.model.device)
        positions = positions_from_mask(mask)
        logits, self._cache = self.model.forward(ids, mask, positions)
        self._key_mask, self._next_position, self._logits = mask, positions[:, -1:] + 1, logits[:, -1]

    def abort(self, request_ids=None) -> None:
        """Forget the given requests (all of them when None), running or ended."""
        if request_ids is None:
            self._requests, self._ended = [], {}
            self._reset()
            return
        doomed = set(request_ids)
        running = [request for request in self._requests if request.request_id in doomed]
        if running:
            self._remove(running)  # moves them to the ended requests, dropped next
        for request_id in doomed:
            self._ended.pop(request_id, None)

    # -- the batch tensors ------------------------------------------------------------

    def _reset(self) -> None:
        self._cache = None
        self._key_mask = None  # [B, T]: 1 on real keys
        self._next_position = None  # [B, 1]
        self._logits = None  # [B, V]: each row's next-token logits
        self._alive = None  # [B] bool: not yet ended

    def _merge(self, cache, key_mask, next_position, logits) -> None:
        merged_cache = concat_rows(self._cache, cache)
        width = cache_length(merged_cache)
        alive = torch.ones(len(key_mask), dtype=torch.bool, device=key_mask.device)
        if self._cache is None:
            self._key_mask, self._next_position, self._logits, self._alive = key_mask, next_position, logits, alive
        else:
            masks = [left_pad_time(self._key_mask, width), left_pad_time(key_mask, width)]
            self._key_mask = torch.cat(masks)
            self._next_position = torch.cat([self._next_position, next_position])
            self._logits = torch.cat([self._logits, logits])
            self._alive = torch.cat([self._alive, alive])
        self._cache = merged_cache

    def _remove(self, leaving: list[DecodeRequest]) -> torch.Tensor:
        """Drop the leaving requests' rows; the kept rows' index (old numbering)."""
        leaving_ids = {request.request_id for request in leaving}
        keep = [torch.arange(rows.start, rows.stop) for request, rows in self._slices()
                if request.request_id not in leaving_ids]
        self._ended.update((request.request_id, request) for request in leaving)
        self._requests = [request for request in self._requests if request.request_id not in leaving_ids]
        if not self._requests:
            self._reset()
            return torch.zeros(0, dtype=torch.long)
        index = torch.cat(keep)
        on_device = index.to(self._key_mask.device)
        self._cache = select_rows(self._cache, on_device)
        self._key_mask, self._next_position = self._key_mask[on_device], self._next_position[on_device]
        self._logits, self._alive = self._logits[on_device], self._alive[on_device]
        self._trim_padding()
        return index

    def _trim_padding(self) -> None:
        """Drop leading columns no remaining row attends to (they came from rows that left)."""
        unused = int(self._key_mask.any(dim=0).int().argmax())
        if unused:
            self._cache = drop_leading_columns(self._cache, unused)
            self._key_mask = self._key_mask[:, unused:]

    def _advance(self, tokens: torch.Tensor) -> None:
        key_mask = torch.cat([self._key_mask, torch.ones_like(self._key_mask[:, :1])], dim=1)
        logits, self._cache = self.model.forward(tokens[:, None], key_mask, self._next_position, self._cache)
        self._key_mask, self._logits = key_mask, logits[:, -1]
        self._next_position = self._next_position + 1

    def _slices(self):
        start = 0
        for request in self._requests:
            yield request, slice(start, start + request.rows)
            start += request.rows

    def _rows_per_request(self, flags: torch.Tensor) -> list[int]:
        """How many rows of each request have ``flags`` set (one device sync)."""
        owner = torch.repeat_interleave(torch.tensor([request.rows for request in self._requests]))
        counts = torch.zeros(len(self._requests), dtype=torch.long, device=flags.device)
        return counts.index_add_(0, owner.to(flags.device), flags.long()).tolist()
