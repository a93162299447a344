"""Hugging Face <-> Megatron weight names and layouts for Llama-style models.

Pure torch (no megatron, no transformers), so it is tested anywhere.

Llama, Mistral, Qwen2/2.5 and Qwen3 share one layout: RMSNorm, rotary
positions, grouped-query attention and a gated SiLU MLP; Qwen3 adds an
RMSNorm over each query and key head (``q_norm`` / ``k_norm``, Megatron's
``q_layernorm`` / ``k_layernorm``), and Qwen3-MoE replaces the MLP with a
router (``mlp.gate``, Megatron's ``mlp.router``) and experts, each a gated
SiLU MLP (``mlp.experts.E.*``, Megatron's ``mlp.experts.local_experts.E.*``
under global expert ids here; a rank of expert parallelism holds a
contiguous range of them, ``with_expert_offset``). Megatron stores two of
their weights fused:

- ``linear_qkv`` holds q, k and v interleaved per query group: for each of
  the ``kv_heads`` groups, that group's ``heads / kv_heads`` query heads,
  then its key head, then its value head (``head_dim`` rows each). This is
  the order Megatron's attention splits its fused projection in, and it
  keeps each group contiguous, so a tensor-parallel shard is a plain slice.
- ``linear_fc1`` holds ``[gate; up]``; under tensor parallelism each rank
  holds ``[gate_r; up_r]``, so merging shards is not a plain concatenation.

One table (``conversion_rules`` with ``tensor_parallel_kind``) drives every
direction: full state dicts, streamed export, weight-sync buckets, and the
per-rank reads of ``tensor_parallel_shards``, which take from the Hugging
Face tensors only the slices a tensor-parallel rank owns.

Names come in two styles: ``fused_norms=False`` for Megatron's local layer
spec (separate ``input_layernorm`` / ``pre_mlp_layernorm`` modules) and
``fused_norms=True`` for the Transformer Engine spec (norm weights live in
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from rldsl.models.hf_checkpoint import HFTensors
from rldsl.plan import hf_expert_count

COPY, QKV, GATED = "copy", "qkv", "gated"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class LlamaShape:
    """The sizes a conversion needs, read from a Hugging Face config."""

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int | None = None  # default hidden_size // num_heads
    tied_embeddings: bool = False
    qkv_bias: bool = False
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_positions: int = 4096
    rope_scaling_factor: float | None = None  # Llama 3.1+'s "llama3" rope scaling (megatron's `rope_scaling`)
    qk_norm: bool = False  # Qwen3's per-head RMSNorm of queries and keys
    num_experts: int = 0  # a mixture of experts in every layer (Qwen3-MoE); 0: a dense MLP
    expert_ffn_hidden_size: int = 0
    router_topk: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1
    router_aux_loss: float = 0.0  # the load-balancing loss's weight

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads do not split into {self.num_kv_heads} groups")

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def queries_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config: Mapping) -> "LlamaShape":
        """From ``config.json`` of a Llama / Mistral / Qwen2 / Qwen3 (-MoE) model;
        another model type is refused (its weights would load into this
        layout silently wrong, as Gemma's extra norms would be dropped)."""
        kind = config.get("model_type")
        if kind is not None and kind not in CONVERTED_MODEL_TYPES:
            raise NotImplementedError(f"model type {kind!r} is not converted to megatron here (it converts "
                                      f"{', '.join(CONVERTED_MODEL_TYPES)}): train it with the fsdp engine")
        rope = config.get("rope_scaling") or config.get("rope_parameters") or {}  # older / newer transformers
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise NotImplementedError("output-projection and MLP biases are not converted")
        return cls(
            hidden_size=config["hidden_size"],
            ffn_hidden_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            head_dim=config.get("head_dim"),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=config.get("model_type") == "qwen2",  # Qwen2 has q/k/v biases its config does not mention
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta") or rope.get("rope_theta", 10000.0),
            max_positions=config.get("max_position_embeddings", 4096),
            rope_scaling_factor=llama3_rope_factor(rope),
            qk_norm=config.get("model_type") in QK_NORM_MODELS,
            **_experts(config),
        )


QK_NORM_MODELS = ("qwen3", "qwen3_moe")
CONVERTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
# Hugging Face tensors no Megatron weight holds, by design: rotary frequencies some checkpoints save
_DERIVED = re.compile(r"\.rotary_emb\.inv_freq$")


def _experts(config: Mapping) -> dict:
    """A Qwen3-MoE config's experts; other mixtures refused (their dense
    ``intermediate_size`` would otherwise build the wrong model)."""
    experts = hf_expert_count(config)
    if not experts:
        return {}
    kind = config.get("model_type")
    if kind != "qwen3_moe":
        raise NotImplementedError(f"a mixture of {experts} experts of model type {kind!r} is not converted to "
                                  f"megatron here (only qwen3_moe is; RLP515): train it with the fsdp engine")
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise NotImplementedError("a Qwen3-MoE with dense layers between its expert layers (`decoder_sparse_step` "
                                  "> 1 or `mlp_only_layers`) is not converted to megatron here")
    return dict(num_experts=experts, expert_ffn_hidden_size=config["moe_intermediate_size"],
                router_topk=config["num_experts_per_tok"], norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                # Hugging Face adds the loss only when the config asks for the router's logits
                router_aux_loss=float(config.get("router_aux_loss_coef", 0.0))
                if config.get("output_router_logits") else 0.0)


# megatron-core's llama3 rope scaling takes the factor; the rest is fixed at Llama 3.1's values
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_rope_factor(rope: Mapping) -> float | None:
    """The factor of Llama 3.1+'s rope scaling (3.1, 3.3: 8; 3.2: 32); None for plain rotary
    embeddings. Other scalings (yarn, linear, dynamic), or llama3 with other fixed values, are refused."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return None
    other = {key: rope.get(key) for key, value in LLAMA3_ROPE_FIXED.items() if rope.get(key, value) != value}
    if kind != "llama3" or other:
        raise NotImplementedError(f"rope scaling {dict(rope)} is not converted: only plain rotary embeddings and "
                                  f"Llama 3.1's `llama3` scaling ({LLAMA3_ROPE_FIXED}, any factor) are")
    return float(rope["factor"])


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the Hugging Face tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    kind: str = COPY


def conversion_rules(shape: LlamaShape, fused_norms: bool = False) -> list[Rule]:
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for layer in range(shape.num_layers):
        rules += _layer_rules(layer, shape, fused_norms)
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if not shape.tied_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return rules


def _layer_rules(layer: int, shape: LlamaShape, fused_norms: bool) -> list[Rule]:
    mc, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    attention, mlp = hf + "self_attn.", hf + "mlp."
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
    # an MoE layer's norm is a module of its own in either spec (no linear_fc1 to fuse it into)
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if fused_norms and not shape.num_experts else \
        "pre_mlp_layernorm.weight"
    rules = [
        Rule(mc + input_norm, (hf + "input_layernorm.weight",)),
        Rule(mc + "self_attention.linear_qkv.weight", tuple(f"{attention}{p}_proj.weight" for p in "qkv"), QKV),
        Rule(mc + "self_attention.linear_proj.weight", (attention + "o_proj.weight",)),
        Rule(mc + mlp_norm, (hf + "post_attention_layernorm.weight",)),
    ]
    if shape.num_experts:
        rules.append(Rule(mc + "mlp.router.weight", (mlp + "gate.weight",)))
        for expert in range(shape.num_experts):
            mce, hfe = f"{mc}mlp.experts.local_experts.{expert}.", f"{mlp}experts.{expert}."
            rules += [Rule(mce + "linear_fc1.weight", (hfe + "gate_proj.weight", hfe + "up_proj.weight"), GATED),
                      Rule(mce + "linear_fc2.weight", (hfe + "down_proj.weight",))]
    else:
        rules += [Rule(mc + "mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), GATED),
                  Rule(mc + "mlp.linear_fc2.weight", (mlp + "down_proj.weight",))]
    if shape.qk_norm:
        rules += [Rule(mc + "self_attention.q_layernorm.weight", (attention + "q_norm.weight",)),
                  Rule(mc + "self_attention.k_layernorm.weight", (attention + "k_norm.weight",))]
    if shape.qkv_bias:
        biases = tuple(f"{attention}{p}_proj.bias" for p in "qkv")
        rules.append(Rule(mc + "self_attention.linear_qkv.bias", biases, QKV))
    return rules


# -- fusing and splitting ----------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LlamaShape) -> torch.Tensor:
    """[q; k; v] (HF) -> per-group interleaved rows (Megatron). Works for weights and biases."""
    groups, d = shape.num_kv_heads, shape.kv_channels
    tail = q.shape[1:]
    parts = (q.reshape(groups, shape.queries_per_group * d, *tail), k.reshape(groups, d, *tail),
             v.reshape(groups, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(fused: torch.Tensor, shape: LlamaShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = shape.num_kv_heads, shape.kv_channels
    tail = fused.shape[1:]
    per_group = fused.reshape(groups, (shape.queries_per_group + 2) * d, *tail)
    q, k, v = torch.split(per_group, [shape.queries_per_group * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _combine(rule: Rule, parts: list[torch.Tensor], shape: LlamaShape) -> torch.Tensor:
    if rule.kind == QKV:
        return fuse_qkv(*parts, shape)
    if rule.kind == GATED:
        return torch.cat(parts, dim=0)
    return parts[0]


def _separate(rule: Rule, tensor: torch.Tensor, shape: LlamaShape) -> tuple[torch.Tensor, ...]:
    if rule.kind == QKV:
        return split_qkv(tensor, shape)
    if rule.kind == GATED:
        return tuple(torch.chunk(tensor, 2, dim=0))
    return (tensor,)


# -- whole state dicts -----------------------------------------------------------


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: LlamaShape, fused_norms: bool = False) -> dict:
    """A full Hugging Face state dict -> a full (unsharded) Megatron one."""
    wanted = [rule.megatron for rule in conversion_rules(shape, fused_norms)]
    return dict(tensor_parallel_shards(as_hf_tensors(hf), shape, 1, 0, wanted, fused_norms))


def megatron_to_hf(megatron: Mapping[str, torch.Tensor], shape: LlamaShape, fused_norms: bool = False) -> dict:
    """A full Megatron state dict -> a Hugging Face one (no ``lm_head`` when tied)."""
    converted = {}
    for name, tensor in megatron.items():
        converted.update(megatron_tensor_to_hf(name, tensor, shape, fused_norms))
    return converted


def megatron_tensor_to_hf(name: str, tensor: torch.Tensor, shape: LlamaShape,
                          fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """One full Megatron tensor -> its Hugging Face tensors (for streaming export)."""
    rule = _rules_by_megatron_name(shape, fused_norms).get(name)
    if rule is None:
        raise KeyError(f"no Hugging Face counterpart for Megatron weight {name!r}")
    return dict(zip(rule.hf, _separate(rule, tensor, shape)))


def _rules_by_megatron_name(shape: LlamaShape, fused_norms: bool) -> dict[str, Rule]:
    return {rule.megatron: rule for rule in conversion_rules(shape, fused_norms)}


class HFToMegatronAssembler:
    """Hugging Face tensors arriving in any order (weight-sync buckets) ->
    complete Megatron tensors, as soon as every part of one has arrived."""

    def __init__(self, shape: LlamaShape, fused_norms: bool = False):
        self.shape = shape
        self._rule_of = {hf: rule for rule in conversion_rules(shape, fused_norms) for hf in rule.hf}
        self._parts: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, tensor in items:
            if hf_name == "lm_head.weight" and self.shape.tied_embeddings:
                continue  # the embedding already is the output layer
            rule = self._rule_of.get(hf_name)
            if rule is None:
                raise KeyError(f"Hugging Face weight {hf_name!r} has no Megatron counterpart")
            parts = self._parts.setdefault(rule.megatron, {})
            parts[hf_name] = tensor
            if len(parts) == len(rule.hf):
                del self._parts[rule.megatron]
                yield rule.megatron, _combine(rule, [parts[n] for n in rule.hf], self.shape)

    def pending(self) -> list[str]:
        """Megatron tensors with some but not all parts received."""
        return sorted(self._parts)


# -- tensor parallelism -----------------------------------------------------------

_COLUMN = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def tensor_parallel_kind(name: str) -> str:
    """How Megatron splits a weight over tensor-parallel ranks:
    ``column`` (dim 0), ``row`` (dim 1), ``gated`` (gate and up each by dim 0)
    or ``replicated``."""
    if name.endswith("linear_fc1.weight"):
        return GATED
    if name.endswith(_COLUMN):
        return "column"
    if name.endswith(_ROW):
        return "row"
    return "replicated"


def split_for_tensor_parallel(name: str, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The per-rank shards of a full Megatron tensor."""
    kind = tensor_parallel_kind(name)
    if kind == "replicated":
        return [tensor] * tp
    if kind == GATED:
        gate, up = torch.chunk(tensor, 2, dim=0)
        return [torch.cat(pair, dim=0) for pair in zip(_even_chunks(gate, tp, 0, name), _even_chunks(up, tp, 0, name))]
    return _even_chunks(tensor, tp, 0 if kind == "column" else 1, name)


def merge_tensor_parallel(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from its shards, in tensor-parallel rank order."""
    kind = tensor_parallel_kind(name)
    if kind == "replicated":
        return shards[0]
    if kind == GATED:
        halves = [torch.chunk(shard, 2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0 if kind == "column" else 1)


def tensor_parallel_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits a Megatron weight along, and
    each of its Hugging Face parts too; None when replicated."""
    kind = tensor_parallel_kind(name)
    if kind == "replicated":
        return None
    return 1 if kind == "row" else 0


def _even_chunks(tensor: torch.Tensor, parts: int, dim: int, name: str) -> list[torch.Tensor]:
    if tensor.shape[dim] % parts:
        raise ValueError(f"{name}: dimension {dim} of size {tensor.shape[dim]} does not split over tp = {parts}")
    return list(torch.chunk(tensor, parts, dim=dim))


# -- one rank's shards, read slice by slice ------------------------------------------


def unconverted(hf_names: Iterable[str], shape: LlamaShape) -> list[str]:
    """Hugging Face tensors that no Megatron weight is made of: a layout this
    conversion does not know (a load would silently drop them)."""
    known = {name for rule in shard_rules(shape) for name in rule.hf} | {"lm_head.weight"}
    return sorted(name for name in hf_names if name not in known and not _DERIVED.search(name))


def as_hf_tensors(hf: Mapping[str, torch.Tensor]) -> HFTensors:
    return hf if isinstance(hf, HFTensors) else HFTensors(hf)


def shard_rules(shape: LlamaShape, fused_norms: bool = False) -> list[Rule]:
    """``conversion_rules`` plus, with tied embeddings, the output layer of a
    last pipeline stage, which holds a copy of the embedding."""
    rules = conversion_rules(shape, fused_norms)
    if shape.tied_embeddings:
        rules.append(Rule("output_layer.weight", ("model.embed_tokens.weight",)))
    return rules


def tensor_parallel_shards(hf: HFTensors, shape: LlamaShape, tp: int, tp_rank: int, wanted: Collection[str],
                           fused_norms: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank ``tp_rank``'s shard of each ``wanted`` Megatron tensor, reading of
    each Hugging Face part only the slice that rank owns.

    Slicing the parts and then fusing them equals fusing and then splitting:
    a rank's ``linear_qkv`` shard is whole query groups (its slices of q, k
    and v, interleaved as for a model with ``kv_heads / tp`` groups), and its
    ``linear_fc1`` shard is ``[gate_r; up_r]``.
    """
    rules = [rule for rule in shard_rules(shape, fused_norms) if rule.megatron in wanted]
    missing = [name for rule in rules for name in rule.hf if name not in hf]
    if missing:
        raise KeyError(f"Hugging Face weights missing {len(missing)} tensors, e.g. {missing[:3]}")
    # only fused attention reads the per-rank heads (an expert's split, over etp ranks, has none)
    local = _tensor_parallel_shape(shape, tp) if any(rule.kind == QKV for rule in rules) else shape
    for rule in rules:
        dim = tensor_parallel_dim(rule.megatron)
        parts = [_rank_slice(hf, name, dim, tp, tp_rank) for name in rule.hf]
        yield rule.megatron, _combine(rule, parts, local)


def _tensor_parallel_shape(shape: LlamaShape, tp: int) -> LlamaShape:
    """The attention sizes of one tensor-parallel rank's query groups."""
    if shape.num_kv_heads % tp:
        raise ValueError(f"{shape.num_kv_heads} key/value heads do not split over tp = {tp}")
    return replace(shape, num_heads=shape.num_heads // tp, num_kv_heads=shape.num_kv_heads // tp,
                   head_dim=shape.kv_channels)


def _rank_slice(hf: HFTensors, name: str, dim: int | None, tp: int, tp_rank: int) -> torch.Tensor:
    if dim is None:
        return hf[name]
    size = hf.shape_of(name)[dim]
    if size % tp:
        raise ValueError(f"{name}: dimension {dim} of size {size} does not split over tp = {tp}")
    step = size // tp
    return hf.read_slice(name, dim, tp_rank * step, (tp_rank + 1) * step)


# -- pipeline parallelism ---------------------------------------------------------


_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def with_expert_offset(name: str, offset: int) -> str:
    """An expert-parallel rank's local expert name -> the global one (its
    experts are ``offset``, ``offset + 1``, ...); a negative offset goes back."""
    match = _EXPERT.search(name)
    if match is None or offset == 0:
        return name
    return f"{name[:match.start(1)]}{int(match.group(1)) + offset}{name[match.end(1):]}"


def is_expert_weight(name: str) -> bool:
    return _EXPERT.search(name) is not None


def with_layer_offset(name: str, offset: int) -> str:
    """A pipeline stage's local layer name -> the global one."""
    match = _LAYER.match(name)
    if match is None or offset == 0:
        return name
    return f"decoder.layers.{int(match.group(1)) + offset}.{name[match.end():]}"
