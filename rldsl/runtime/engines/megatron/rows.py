"""Rows packed for a megatron-core forward, and the log-probabilities of their responses.

Each row becomes its real prompt tokens followed by its response tokens,
right-padded. With causal attention the padding after a row's tokens cannot
influence them, so one causal mask and positions ``0..L-1`` serve every row
and no padding mask is needed (which keeps Megatron's fused causal attention
kernels usable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from rldsl.runtime.engines.megatron.model import transformer_engine_available
from rldsl.runtime.engines.torch.common import logit_divisor
from rldsl.runtime.protocols import FIELD_PROMPT_IDS, FIELD_PROMPT_MASK, FIELD_RESPONSE_IDS, FIELD_RESPONSE_MASK


@dataclass
class PackedRows:
    """Rows as ``[real prompt tokens][response tokens][padding]``."""

    tokens: torch.Tensor  # int64 [n, L]
    positions: torch.Tensor  # int64 [n, L]
    response_start: torch.Tensor  # int64 [n]: index of the first response token
    response_mask: torch.Tensor  # [n, Lr]
    batch: Mapping[str, torch.Tensor]  # the original fields, on the device
    temperature: float = 1.0  # the generators' sampling temperature: logprobs are taken at it

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


def packed_length(batch: Mapping[str, torch.Tensor]) -> int:
    return int(batch[FIELD_PROMPT_MASK].sum(dim=1).max()) + batch[FIELD_RESPONSE_IDS].shape[1]


def pipeline_length(length: int, config) -> int:
    """The sequence length pipeline stages exchange for rows of ``length``
    tokens: under sequence parallelism a multiple of tp (each rank sends its
    1/tp of the positions), else ``length``."""
    return length + (-length % config.tensor_model_parallel_size if config.sequence_parallel else 0)


def pack_rows(batch: Mapping[str, torch.Tensor], device, length: int | None = None,
              rows: int | None = None, temperature: float = 1.0) -> PackedRows:
    """Pack rows (optionally padded to ``length`` tokens and ``rows`` rows, so
    that every pipeline microbatch has one shape)."""
    batch = {name: value.to(device) for name, value in batch.items()}
    prompt_ids, prompt_mask = batch[FIELD_PROMPT_IDS], batch[FIELD_PROMPT_MASK]
    response_ids = batch[FIELD_RESPONSE_IDS]
    count, response_length = response_ids.shape
    prompt_lengths = prompt_mask.sum(dim=1)
    length = length or packed_length(batch)
    total_rows = max(rows or count, count)
    tokens = torch.zeros(total_rows, length, dtype=torch.long, device=device)
    for row in range(count):
        prompt = prompt_ids[row][prompt_mask[row].bool()]
        tokens[row, : len(prompt)] = prompt
        tokens[row, len(prompt) : len(prompt) + response_length] = response_ids[row]
    start = torch.zeros(total_rows, dtype=torch.long, device=device)
    start[:count] = prompt_lengths
    mask = torch.zeros(total_rows, response_length, dtype=batch[FIELD_RESPONSE_MASK].dtype, device=device)
    mask[:count] = batch[FIELD_RESPONSE_MASK]
    positions = torch.arange(length, device=device).expand(total_rows, length)
    return PackedRows(tokens, positions, start, mask, batch, temperature)


def causal_mask(length: int, device) -> torch.Tensor | None:
    """Megatron's local attention takes a boolean mask (True = hidden); its
    Transformer Engine attention applies the causal mask itself."""
    if transformer_engine_available():
        return None
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(model, packed: PackedRows) -> torch.Tensor:
    """[n, L, vocab / tp] logits on the last pipeline stage (hidden states elsewhere).
    Under sequence parallelism the rows are right-padded to a multiple of tp
    (each rank holds 1/tp of the positions), which causal attention keeps
    from the real tokens; the padding's logits are cut off."""
    tokens, length = packed.tokens, packed.length
    pad = -length % model.config.tensor_model_parallel_size if model.config.sequence_parallel else 0
    if pad:
        tokens = torch.nn.functional.pad(tokens, (0, pad))
    positions = torch.arange(length + pad, device=tokens.device).expand(len(tokens), length + pad) if pad \
        else packed.positions
    logits = model(tokens, positions, attention_mask=causal_mask(length + pad, tokens.device))
    return logits[:, :length] if pad else logits


def response_logprobs_from_logits(logits: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """log p(response token | prefix) [n_real, Lr] at the rows' sampling
    temperature, float32, 0 off the response mask.

    The cross entropy runs over the vocabulary shards of the tensor-parallel
    group, so it is exact for any tp. Differentiable.
    """
    from megatron.core import tensor_parallel

    labels = torch.zeros_like(packed.tokens)
    labels[:, :-1] = packed.tokens[:, 1:]
    token_logprobs = -tensor_parallel.vocab_parallel_cross_entropy(logits.float() / logit_divisor(packed.temperature),
                                                                   labels)
    response_length = packed.response_mask.shape[1]
    # The response token at index start + j is predicted at start + j - 1.
    index = packed.response_start[:, None] - 1 + torch.arange(response_length, device=labels.device)[None]
    picked = token_logprobs.gather(1, index.clamp(min=0, max=packed.length - 1))
    real_rows = len(packed.batch[FIELD_RESPONSE_IDS])
    return (picked * packed.response_mask.to(picked.dtype))[:real_rows]


def empty_round(device) -> PackedRows:
    """An empty expert round's forward (experts.ExpertLockstep): one token, no rows to score."""
    return PackedRows(torch.ones(1, 1, dtype=torch.long, device=device),
                      torch.zeros(1, 1, dtype=torch.long, device=device), None, None, {})


def empty_forward_step(data_iterator, model):
    """A schedule's forward step of an empty expert round (experts.ExpertLockstep): a zero loss over no tokens."""
    logits = forward_logits(model, next(data_iterator))
    nothing = torch.zeros((), dtype=torch.int, device=logits.device)
    return logits, lambda out: (out.sum() * 0.0, nothing, {})


def forward_only(model, packed: list, length: int, rows: int, forward_step) -> list:
    """Megatron's schedule over ``packed`` (pipeline microbatches of ``rows``
    rows, ``length`` tokens), forward only: on the last pipeline stage each
    microbatch's reported values, elsewhere nothing."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(packed), model=[model],
                                       num_microbatches=len(packed), seq_length=length, micro_batch_size=rows,
                                       forward_only=True)
