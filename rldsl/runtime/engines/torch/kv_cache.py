"""Row-level surgery on a model's key/value cache, for continuous batching.

Two cache formats reach the torch generator: the builtin model's list of
``(k, v)`` pairs and a Hugging Face ``DynamicCache`` (``.layers[i].keys`` /
``.values``). Both hold, per layer, keys and values shaped [B, H, T, D], so
every operation here works on those pairs and writes them back in the
cache's own format.

Merging two batches left-pads the shorter cache along the time axis with
zeros. The attention mask marks those columns 0 and each row's positions come
from its own mask, so the padding changes nothing but float rounding.
"""

from __future__ import annotations

import torch

KVPairs = list[tuple[torch.Tensor, torch.Tensor]]


def cache_pairs(cache) -> KVPairs:
    """The (keys, values) of every layer, whatever the cache format."""
    if hasattr(cache, "layers"):
        _require_full_attention(cache)
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(keys, values) for keys, values in cache]


def with_pairs(cache, pairs: KVPairs):
    """``cache`` holding ``pairs`` instead (a ``DynamicCache`` is updated in place)."""
    if hasattr(cache, "layers"):
        for layer, (keys, values) in zip(cache.layers, pairs):
            layer.keys, layer.values = keys, values
        return cache
    return list(pairs)


def select_rows(cache, index: torch.Tensor):
    """Keep the rows ``index`` (in that order)."""
    return with_pairs(cache, [(keys[index], values[index]) for keys, values in cache_pairs(cache)])


def drop_leading_columns(cache, count: int):
    """Drop the first ``count`` time steps (columns every row has masked)."""
    if count == 0:
        return cache
    return with_pairs(cache, [(keys[:, :, count:], values[:, :, count:]) for keys, values in cache_pairs(cache)])


def concat_rows(first, second):
    """Rows of ``first`` then rows of ``second``; the shorter is left-padded in time."""
    if first is None:
        return second
    width = max(cache_length(first), cache_length(second))
    merged = [
        (torch.cat([left_pad_time(k1, width), left_pad_time(k2, width)]),
         torch.cat([left_pad_time(v1, width), left_pad_time(v2, width)]))
        for (k1, v1), (k2, v2) in zip(cache_pairs(first), cache_pairs(second))
    ]
    return with_pairs(first, merged)


def cache_length(cache) -> int:
    return cache_pairs(cache)[0][0].shape[2]


def left_pad_time(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zeros prepended along dim 2 (time of a [B, H, T, D] tensor), or dim 1 of a [B, T] mask."""
    axis = 2 if tensor.dim() == 4 else 1
    missing = width - tensor.shape[axis]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=axis)


def _require_full_attention(cache) -> None:
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise NotImplementedError(
                f"continuous batching needs full-attention cache layers; got {type(layer).__name__} "
                "(a sliding-window cache cannot be left-padded)"
            )
