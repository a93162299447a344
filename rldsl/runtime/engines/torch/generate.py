"""``TorchGenerator``: batched sampling with a KV cache for the torch engine.

``generate`` decodes one prompt group; the stepwise API (``admit``,
``decode_step``, ``finish_request``) lets a ``ContinuousBatcher``
(``rldsl.runtime.engines.batching``) decode many groups in one running batch
that requests join and leave between steps (``decode_batch.py``).

Behaviour logprobs are the log-probabilities of the sampled tokens under the
model's own distribution at temperature 1 without top-p truncation, i.e. the
same quantity the trainer computes with ``response_logprobs``. They are
recomputed with that very function after sampling, so with unchanged weights
the trainer's importance ratio is 1 up to float rounding (not merely close:
the same code on the same tensors). Temperature and top-p shape only which
tokens are drawn.
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
    FIELD_VERSION,
    Batch,
    Prompt,
)


class TorchGenerator(WeightReceiver):
    GREEDY_ROWS_PER_DECODE = 256  # bounds the KV cache when evaluating a large split

    def __init__(self, model, max_new_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0):
        if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("need max_new_tokens >= 1, temperature >= 0 and top_p in (0, 1]")
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.version = 0
        model.module.eval()
        self._running = self._new_decode_batch()

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def generate(self, prompts: list[Prompt], samples_per_prompt: int, seed: int) -> Batch:
        """Rows prompt-major; the same seed and weights give the same batch."""
        decoding = self._new_decode_batch()
        (request_id,) = self._admit_into(decoding, [(prompts, samples_per_prompt, seed)])
        while not decoding.step():
            pass
        return self._completed(*decoding.take(request_id))

    # -- the stepwise API a ContinuousBatcher drives (one running batch) ---------------

    def admit(self, requests: list[tuple[list[Prompt], int, int]]) -> list[int]:
        """Prefill ``(prompts, samples_per_prompt, seed)`` requests into the
        running batch (one forward for all); their request ids. On error the
        running batch is unchanged."""
        return self._admit_into(self._running, requests)

    def decode_step(self) -> list[int]:
        """One token for every row in flight; the ids of the requests that ended."""
        self.require_consistent_weights()
        return self._running.step()

    def finish_request(self, request_id: int) -> Batch:
        """An ended request's batch, as ``generate`` returns it."""
        return self._completed(*self._running.take(request_id))

    def abort_requests(self, request_ids: list[int] | None = None) -> None:
        """Drop requests (all of them when None), e.g. after a failed step."""
        self._running.abort(request_ids)

    @property
    def rows_in_flight(self) -> int:
        return self._running.rows

    def generate_greedy(self, prompts: list[Prompt]) -> list[str]:
        """One argmax response per prompt, for evaluation."""
        self.require_consistent_weights()
        texts = [prompt.text for prompt in prompts]
        responses = []
        for start in range(0, len(texts), self.GREEDY_ROWS_PER_DECODE):
            chunk = texts[start : start + self.GREEDY_ROWS_PER_DECODE]
            responses += decode_responses(self.tokenizer, self._decode(chunk, lambda logits: logits.argmax(dim=-1)))
        return responses

    def decode(self, batch: Batch) -> list[str]:
        return decode_responses(self.tokenizer, batch)

    @torch.no_grad()
    def _decode(self, texts: list[str], choose) -> Batch:
        """Prefill the prompts, then one token per step from the KV cache until
        every row has emitted EOS or ``max_new_tokens`` is reached."""
        device, eos = self.model.device, self.model.eos_id
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, texts, device)
        positions = positions_from_mask(prompt_mask)
        logits, cache = self.model.forward(prompt_ids, prompt_mask, positions)
        next_position, key_mask = positions[:, -1:] + 1, prompt_mask
        alive = torch.ones(len(texts), dtype=torch.bool, device=device)
        tokens, masks = [], []
        for _ in range(self.max_new_tokens):
            token = torch.where(alive, choose(logits[:, -1].float()).to(device), 0)
            tokens.append(token)
            masks.append(alive.long())
            alive = alive & (token != eos)
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
        return DecodeBatch(self.model, self.max_new_tokens, self._sample)

    def _admit_into(self, decoding: DecodeBatch, requests) -> list[int]:
        self.require_consistent_weights()
        groups = []
        for prompts, samples_per_prompt, seed in requests:
            if not prompts or samples_per_prompt < 1:
                raise ValueError("generate needs at least one prompt and samples_per_prompt >= 1")
            texts = [prompt.text for prompt in prompts for _ in range(samples_per_prompt)]
            groups.append((texts, torch.Generator(device="cpu").manual_seed(seed)))
        return decoding.admit(groups, self.version)

    def _completed(self, batch: Batch, version: int) -> Batch:
        """Add behaviour logprobs (the trainer's own computation) and the version."""
        if version != self.version:
            raise RuntimeError(f"weights changed to version {self.version} while a request decoded with {version}")
        with torch.no_grad():
            batch[FIELD_BEHAVIOUR_LOGPROBS] = response_logprobs(self.model, batch).cpu()
        batch[FIELD_VERSION] = torch.full((len(batch[FIELD_RESPONSE_IDS]),), version, dtype=torch.long)
        return batch

    def _sample(self, logits: torch.Tensor, groups: list[tuple[slice, torch.Generator]]) -> torch.Tensor:
        """One token per row. Each request's rows draw from its own generator,
        so a group's samples do not depend on what else is in the batch."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.cpu() / self.temperature, dim=-1)
        if self.top_p < 1:
            probs = _top_p_filter(probs, self.top_p)
        return torch.cat([torch.multinomial(probs[rows], 1, generator=sampler).squeeze(-1) for rows, sampler in groups])


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
