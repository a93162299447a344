"""Token-budget forwards: which rows of a microbatch go into one forward.

With a token budget (``micro_batch_tokens`` in a pipeline file), a
microbatch's rows are split into forwards whose real tokens (prompt +
response, padding not counted) stay within the budget; a single row longer
than the budget goes alone. Every loss is a sum over rows, so any split
gives the same gradients.

``token_budget_chunks`` is pure; the batch helpers take rows out of a batch
and trim the padding every row of a forward shares.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from rldsl.runtime.engines.torch.common import left_align
from rldsl.runtime.protocols import (
    FIELD_BEHAVIOUR_LOGPROBS,
    FIELD_LOSS_MASK,
    FIELD_PROMPT_IDS,
    FIELD_PROMPT_MASK,
    FIELD_REF_LOGPROBS,
    FIELD_RESPONSE_IDS,
    FIELD_RESPONSE_MASK,
)

# [n, Lr] fields aligned with the response tokens: trimmed together.
RESPONSE_ALIGNED = (FIELD_RESPONSE_IDS, FIELD_RESPONSE_MASK, FIELD_BEHAVIOUR_LOGPROBS, FIELD_REF_LOGPROBS,
                    FIELD_LOSS_MASK)


def token_budget_chunks(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices grouped so each group's summed length is <= ``budget``.

    Balanced first-fit decreasing: first-fit decreasing finds how many
    groups are needed, then the rows, longest first, go to the least loaded
    group they fit in (a new group when none has room), so the forwards are
    of similar size. Groups list their rows in order and are ordered by
    their first row, so the result is deterministic.
    """
    if budget <= 0:
        raise ValueError(f"token budget must be positive, got {budget}")
    order = sorted(range(len(lengths)), key=lambda row: (-lengths[row], row))
    loads = [0] * _first_fit_count(order, lengths, budget)
    groups: list[list[int]] = [[] for _ in loads]
    for row in order:
        fitting = [g for g, load in enumerate(loads) if load + lengths[row] <= budget or not groups[g]]
        target = min(fitting, key=lambda g: (loads[g], g)) if fitting else len(loads)
        if target == len(loads):
            loads.append(0)
            groups.append([])
        loads[target] += lengths[row]
        groups[target].append(row)
    return sorted((sorted(group) for group in groups if group), key=lambda group: group[0])


def _first_fit_count(order: list[int], lengths: Sequence[int], budget: int) -> int:
    loads: list[int] = []
    for row in order:
        slot = next((g for g, load in enumerate(loads) if load + lengths[row] <= budget), None)
        if slot is None:
            loads.append(lengths[row])
        else:
            loads[slot] += lengths[row]
    return len(loads)


def real_lengths(batch: Mapping[str, torch.Tensor]) -> list[int]:
    """Prompt + response tokens of each row, padding left out."""
    return (batch[FIELD_PROMPT_MASK].sum(dim=1) + batch[FIELD_RESPONSE_MASK].sum(dim=1)).tolist()


def forward_rows(batch: Mapping[str, torch.Tensor], rows_per_forward: int | None,
                 tokens_per_forward: int = 0) -> list[list[int]]:
    """The rows of each forward: by token budget when one is set, else in
    consecutive runs of ``rows_per_forward`` (all rows at once if None)."""
    size = len(batch[FIELD_RESPONSE_IDS])
    if tokens_per_forward:
        return token_budget_chunks([int(n) for n in real_lengths(batch)], tokens_per_forward)
    step = rows_per_forward or max(size, 1)
    return [list(range(start, min(start + step, size))) for start in range(0, size, step)]


def concat_rows(batches: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One batch of the rows of ``batches``, in order: the prompt fields
    padded on the left to the widest, every other per-token field on the
    right; padding is masked, so each row's logprobs are unchanged."""
    if len(batches) == 1:
        return dict(batches[0])
    out = {}
    for name in batches[0]:
        values = [batch[name] for batch in batches]
        if values[0].dim() == 1:
            out[name] = torch.cat(values)
            continue
        width = max(value.shape[1] for value in values)
        left = name in (FIELD_PROMPT_IDS, FIELD_PROMPT_MASK)
        out[name] = torch.cat([torch.nn.functional.pad(value, (width - value.shape[1], 0) if left else
                                                       (0, width - value.shape[1])) for value in values])
    return out


def take_rows(batch: Mapping[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    index = torch.tensor(rows, dtype=torch.long)
    return {name: value[index.to(value.device)] for name, value in batch.items()}


def trim_padding(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the prompt columns that are padding in every row (prompts are
    left-aligned first) and the response columns past the longest response.
    Masked columns carry nothing, so the logprobs and the loss are unchanged."""
    trimmed = dict(batch)
    prompt_ids, prompt_mask = left_align(batch[FIELD_PROMPT_IDS], batch[FIELD_PROMPT_MASK])
    prompt_width = max(int(prompt_mask.sum(dim=1).max()), 1) if len(prompt_mask) else 0
    trimmed[FIELD_PROMPT_IDS] = prompt_ids[:, prompt_ids.shape[1] - prompt_width:]
    trimmed[FIELD_PROMPT_MASK] = prompt_mask[:, prompt_mask.shape[1] - prompt_width:]
    response_width = response_extent(batch[FIELD_RESPONSE_MASK])
    for name in RESPONSE_ALIGNED:
        if name in batch:
            trimmed[name] = batch[name][:, :response_width]
    return trimmed


def response_extent(response_mask: torch.Tensor) -> int:
    """Columns up to the last real response token of any row."""
    columns = torch.nonzero(response_mask.sum(dim=0))
    return int(columns.max()) + 1 if len(columns) else 0


def scatter_rows(chunks: Iterator[tuple[list[int], torch.Tensor]], rows: int, width: int) -> torch.Tensor:
    """[rows, width] float32 from per-forward results [len(chunk rows), <= width]."""
    out = torch.zeros(rows, width)
    for chunk_rows, values in chunks:
        out[torch.tensor(chunk_rows, dtype=torch.long), : values.shape[1]] = values.float().cpu()
    return out
