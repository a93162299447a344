"""``builtin:tiny-lm``: a small causal transformer.

The model is deliberately plain: token + learned position embeddings,
pre-norm blocks, causal self-attention with a key/value cache for
incremental decoding, and an output head tied to the token embedding (so the
state dict has no duplicate tensor to sync).

Engines hold it behind ``CausalLM`` (``rldsl.models.base``), like a local
Hugging Face model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rldsl.models.base import BUILTIN_TINY, CausalLM
from rldsl.models.tokenizer import CharTokenizer

MASKED_SCORE = -1e9  # finite, so a row with every key masked (left padding) stays NaN-free


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_positions: int = 64

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)

    def forward(self, x, score_bias, past_kv=None):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
        mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=score_bias)
        return self.out(mixed.transpose(1, 2).reshape(batch, length, width)), (k, v)


class Block(nn.Module):
    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.norm_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.norm_mlp = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff), nn.GELU(), nn.Linear(config.d_ff, config.d_model)
        )

    def forward(self, x, score_bias, past_kv=None):
        attended, kv = self.attn(self.norm_attn(x), score_bias, past_kv)
        x = x + attended
        return x + self.mlp(self.norm_mlp(x)), kv


class TinyLM(nn.Module):
    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.max_positions, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = nn.LayerNorm(config.d_model)
        self._init_weights()

    def _init_weights(self):
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if "norm" in name:
                continue  # LayerNorm keeps its ones / zeros
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif name.endswith(("attn.out.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=residual_std)
            else:
                nn.init.normal_(param, std=0.02)

    def forward(self, input_ids, attention_mask, position_ids, cache=None):
        """Logits [B, T, V] and the new cache (one (k, v) per block).

        ``attention_mask`` is [B, T_cached + T]: 1 on keys that may be attended.
        None (no cache): several sequences packed in a row, each starting
        where ``position_ids`` restarts at 0; attention stays within each.
        """
        if int(position_ids.max()) >= self.config.max_positions:
            raise ValueError(
                f"sequence needs position {int(position_ids.max())} but tiny-lm has "
                f"max_positions={self.config.max_positions}; shorten prompts or max_new_tokens"
            )
        x = self.token_embedding(input_ids) + self.position_embedding(position_ids)
        if attention_mask is None:
            score_bias = _packed_score_bias(position_ids, dtype=x.dtype)
        else:
            score_bias = _score_bias(attention_mask, new_tokens=input_ids.shape[1], dtype=x.dtype)
        new_cache = []
        for index, block in enumerate(self.blocks):
            x, kv = block(x, score_bias, None if cache is None else cache[index])
            new_cache.append(kv)
        logits = F.linear(self.final_norm(x), self.token_embedding.weight)
        return logits, new_cache


def _score_bias(key_mask, new_tokens: int, dtype):
    """Additive attention bias [B, 1, T_new, T_keys]: causal and key padding."""
    total = key_mask.shape[1]
    query_pos = torch.arange(total - new_tokens, total, device=key_mask.device)
    key_pos = torch.arange(total, device=key_mask.device)
    allowed = (key_pos[None, :] <= query_pos[:, None])[None] & key_mask[:, None, :].bool()
    bias = torch.zeros(allowed.shape, dtype=dtype, device=key_mask.device)
    return bias.masked_fill_(~allowed, MASKED_SCORE)[:, None]


def _packed_score_bias(position_ids, dtype):
    """Additive attention bias [B, 1, T, T] for packed rows: causal, and a
    query sees only the keys of its own sequence (a sequence starts where
    the position restarts at 0)."""
    segment = torch.cumsum((position_ids == 0).to(torch.int64), dim=1)
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = causal[None] & (segment[:, :, None] == segment[:, None, :])
    bias = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return bias.masked_fill_(~allowed, MASKED_SCORE)[:, None]


def build_tiny_lm(seed: int = 0, tokenizer: CharTokenizer | None = None, source: str = BUILTIN_TINY,
                  **overrides) -> CausalLM:
    """A freshly initialised tiny-lm (``source``: the builtin model it is,
    whose vocabulary ``tokenizer`` holds); the same seed gives the same weights."""
    tokenizer = tokenizer or CharTokenizer()
    config = TinyLMConfig(vocab_size=tokenizer.vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = TinyLM(config)
    return CausalLM(module, tokenizer, source, config.to_dict())
