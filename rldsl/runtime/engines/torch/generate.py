"""``TorchGenerator``: batched sampling with a KV cache for the torch engine.

``generate`` decodes one prompt group; the stepwise API (``admit``,
``decode_step``, ``finish_request``) lets a ``ContinuousBatcher``
(``rldsl.runtime.engines.batching``) decode many groups in one running batch
that requests join and leave between steps (``decode_batch.py``).

Behaviour logprobs are the log-probabilities of the sampled tokens under the
model's distribution at the sampling temperature without top-p truncation,
i.e. the same quantity the trainer computes with ``response_logprobs`` at
that temperature. They are recomputed with that very function after
sampling, so with unchanged weights the trainer's importance ratio is 1 up to
float rounding (not merely close: the same code on the same tensors). Top-k
and top-p shape only which tokens are drawn.

``interrupts``: a weight version may be applied with rows in flight (``update
= interrupt``): the running batch is prefilled again under the new weights
and decoding goes on. Such a request's rows carry ``token_versions`` (the
version that drew each token) and ``version`` is their oldest; its behaviour
logprobs are the ones recorded as each token was drawn, under the weights
that drew it (equal to the trainer's computation up to float rounding).
"""

from __future__ import annotations

import torch

from rldsl.runtime.engines.torch.common import (
    WeightReceiver,
    decode_responses,
    encode_prompts,
    positions_from_mask,
    response_logprobs,
)
from rldsl.runtime.engines.torch.decode_batch import DecodeBatch
from rldsl.runtime.protocols import (
    FIELD_BEHAVIOUR_LOGPROBS,
    FIELD_PROMPT_IDS,
    FIELD_PROMPT_MASK,
    FIELD_RESPONSE_IDS,
    FIELD_RESPONSE_MASK,
    FIELD_TOKEN_VERSIONS,
    FIELD_VERSION,
    Batch,
    Prompt,
)


class TorchGenerator(WeightReceiver):
    GREEDY_ROWS_PER_DECODE = 256  # bounds the KV cache when evaluating a large split
    interrupts = True  # rows in flight resume under new weights (ContinuousBatcher, update = interrupt)

    def __init__(self, model, max_new_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, stop_token_ids: tuple[int, ...] = (), min_new_tokens: int = 0):
        if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1 or top_k < 0 \
                or not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError("need max_new_tokens >= 1, temperature >= 0, top_p in (0, 1], top_k >= 0 and "
                             "min_new_tokens in [0, max_new_tokens]")
        self.model = model
        self.max_new_tokens, self.min_new_tokens = max_new_tokens, min_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.end_ids = torch.tensor([model.eos_id, *stop_token_ids], dtype=torch.long)  # a row ends on any
        self.version = 0
        self.tokens_decoded = 0  # one per row in flight per decode step
        model.module.eval()
        self._running = self._new_decode_batch()

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def context_limit(self) -> int | None:
        """Positions the model reads at most, prompt and response together."""
        config = self.model.config
        return config.get("max_positions") or config.get("max_position_embeddings") or config.get("n_positions")

    def generate(self, prompts: list[Prompt], samples_per_prompt: int, seed: int) -> Batch:
        """Rows prompt-major; the same seed and weights give the same batch."""
        decoding = self._new_decode_batch()
        (request_id,) = self._admit_into(decoding, [(prompts, samples_per_prompt, seed)])
        while not decoding.step():
            pass
        return self._completed(decoding.take(request_id))

    # -- the stepwise API a ContinuousBatcher drives (one running batch) ---------------

    def admit(self, requests: list[tuple[list[Prompt], int, int]]) -> list[int]:
        """Prefill ``(prompts, samples_per_prompt, seed)`` requests into the
        running batch (one forward for all); their request ids. On error the
        running batch is unchanged."""
        return self._admit_into(self._running, requests)

    def decode_step(self) -> list[int]:
        """One token for every row in flight; the ids of the requests that ended."""
        self.require_consistent_weights()
        rows = self._running.rows
        ended = self._running.step()
        self.tokens_decoded += rows  # the watchdog's evidence of progress inside a long group
        return ended

    def finish_request(self, request_id: int) -> Batch:
        """An ended request's batch, as ``generate`` returns it."""
        return self._completed(self._running.take(request_id))

    def update_weights(self, bucket, version: int, last: bool) -> None:
        """Load a bucket; with the last one, rows in flight resume under the new weights."""
        super().update_weights(bucket, version, last)
        if last:
            self._running.resume(self.version)

    def abort_requests(self, request_ids: list[int] | None = None) -> None:
        """Drop requests (all of them when None), e.g. after a failed step."""
        self._running.abort(request_ids)

    @property
    def rows_in_flight(self) -> int:
        return self._running.rows

    def generate_greedy(self, prompts: list[Prompt]) -> list[str]:
        """One argmax response per prompt, for evaluation."""
        self.require_consistent_weights()
        responses = []
        for start in range(0, len(prompts), self.GREEDY_ROWS_PER_DECODE):
            chunk = prompts[start : start + self.GREEDY_ROWS_PER_DECODE]
            responses += decode_responses(self.tokenizer, self._decode(chunk, lambda logits: logits.argmax(dim=-1)))
        return responses

    def decode(self, batch: Batch) -> list[str]:
        return decode_responses(self.tokenizer, batch)

    @torch.no_grad()
    def _decode(self, prompts: list[Prompt], choose) -> Batch:
        """Prefill the prompts, then one token per step from the KV cache until
        every row has emitted EOS or ``max_new_tokens`` is reached."""
        device, end_ids = self.model.device, self.end_ids.to(self.model.device)
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts, device)
        positions = positions_from_mask(prompt_mask)
        logits, cache = self.model.forward(prompt_ids, prompt_mask, positions)
        next_position, key_mask = positions[:, -1:] + 1, prompt_mask
        alive = torch.ones(len(prompts), dtype=torch.bool, device=device)
        tokens, masks = [], []
        for _ in range(self.max_new_tokens):
            token = torch.where(alive, choose(logits[:, -1].float()).to(device), 0)
            tokens.append(token)
            masks.append(alive.long())
            alive = alive & ~torch.isin(token, end_ids)
            if not alive.any():
                break
            key_mask = torch.cat([key_mask, torch.ones_like(key_mask[:, :1])], dim=1)
            logits, cache = self.model.forward(token[:, None], key_mask, next_position, cache)
            next_position = next_position + 1
        return {
            FIELD_PROMPT_IDS: prompt_ids.cpu(),
            FIELD_PROMPT_MASK: prompt_mask.cpu(),
            FIELD_RESPONSE_IDS: torch.stack(tokens, dim=1).cpu(),
            FIELD_RESPONSE_MASK: torch.stack(masks, dim=1).cpu(),
        }

    def _new_decode_batch(self) -> DecodeBatch:
        return DecodeBatch(self.model, self.max_new_tokens, self._sample, self.end_ids, self.temperature,
                           self.min_new_tokens)

    def _admit_into(self, decoding: DecodeBatch, requests) -> list[int]:
        self.require_consistent_weights()
        groups = []
        for prompts, samples_per_prompt, seed in requests:
            if not prompts or samples_per_prompt < 1:
                raise ValueError("generate needs at least one prompt and samples_per_prompt >= 1")
            rows = [prompt for prompt in prompts for _ in range(samples_per_prompt)]
            groups.append((rows, torch.Generator(device="cpu").manual_seed(seed)))
        return decoding.admit(groups, self.version)

    def _completed(self, request) -> Batch:
        """Add behaviour logprobs and the version. Drawn with today's weights
        only: the trainer's own computation. Across versions: as recorded at
        each draw, with ``token_versions`` and the oldest as ``version``."""
        batch, rows = request.batch(), request.rows
        if set(request.versions) == {self.version}:
            with torch.no_grad():
                batch[FIELD_BEHAVIOUR_LOGPROBS] = response_logprobs(self.model, batch, self.temperature).cpu()
        else:
            batch[FIELD_BEHAVIOUR_LOGPROBS] = request.step_logprobs().float()
            batch[FIELD_TOKEN_VERSIONS] = torch.tensor(request.versions, dtype=torch.long).expand(rows, -1).clone()
        batch[FIELD_VERSION] = torch.full((rows,), min(request.versions), dtype=torch.long)
        return batch

    def _sample(self, logits: torch.Tensor, groups: list[tuple[slice, torch.Generator]]) -> torch.Tensor:
        """One token per row. Each request's rows draw from its own generator,
        so a group's samples do not depend on what else is in the batch."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.cpu() / self.temperature, dim=-1)
        if self.top_k:
            probs = _top_k_filter(probs, self.top_k)
        if self.top_p < 1:
            probs = _top_p_filter(probs, self.top_p)
        return torch.cat([torch.multinomial(probs[rows], 1, generator=sampler).squeeze(-1) for rows, sampler in groups])


def _top_k_filter(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` most likely tokens (``multinomial`` renormalises)."""
    if top_k >= probs.shape[-1]:
        return probs
    kth = probs.topk(top_k, dim=-1).values[..., -1:]
    return probs.masked_fill(probs < kth, 0.0)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
