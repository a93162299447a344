"""Bytes one GPU holds for one stage, per engine and phase: the formulas.

Pure arithmetic on a model's shape and a stage's settings; rldsl.compiler.memory
finds those settings in a placed program. Sizes are bytes; ``c`` is the
compute dtype's bytes per value (fp32 4, bf16/fp16 2).

A trainer rank passes through two phases and its peak is the larger:

- train step: the resident state plus what a microbatch's forward and
  backward add (gathered layers, activations);
- weight sync: the resident state plus the export's buckets (one bucket
  being filled while the previous one is copied out, so about two).

Activations, with activation checkpointing (fsdp, megatron), for a
microbatch of T tokens on one rank:

    layers x hidden x T x c            every layer's checkpointed input
  + T x (8 hidden + 2 kv + 4 ffn) x c  one layer recomputed in full for its backward
  + T x vocab x 4                      the logits, log-softmaxed in fp32

The first term is what checkpointing keeps; the second is the one layer
whose activations are rebuilt during the backward (norm inputs and outputs,
q, k, v, attention output, residuals: ~8 hidden; k and v: 2 kv; gate, up,
activation and product: 4 ffn); the third usually dominates for a 150k
vocabulary. Without checkpointing (the torch engine) every layer keeps the
second term. Megatron splits all three over tensor parallelism (sequence
parallel activations, vocab-parallel logits).

A logprob forward (no gradients) holds one layer's activations and the
logits. The torch and fsdp engines log-softmax them a slice of
LOGPROB_SLICE_TOKENS positions at a time (rldsl.runtime.engines.torch.common):

    T x vocab x c                      the logits, in the compute dtype
  + 2 x S x vocab x 4                  one slice upcast to fp32 and its log-softmax
                                       (fp32 logits need no upcast: 1 x)

where megatron log-softmaxes all T x vocab (/ tp) in fp32.

A logprob stage scores each group as it arrives, beside generation and
training: nothing puts it to sleep for a turn, so its peak counts in every
phase of the other stages on its GPUs (``StageMemory.concurrent``), whether
it rests with its weights in host memory (``offload``) or on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import log

from rldsl.plan import hf_expert_count

# Engines whose trainers checkpoint every layer's activations (the design
# both follow at scale); the torch engine keeps them all.
CHECKPOINTS_ACTIVATIONS = {"fsdp": True, "megatron": True, "torch": False}
FSDP_LAYERS_IN_FLIGHT = 2  # the layer computing and the one prefetched
LOGIT_BYTES = 4  # log-softmax in fp32
LOGPROB_SLICE_TOKENS = 1024  # the torch engines' log-softmax slice (kept equal by a test)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    ffn: int  # the MLP's inner width (gated: three matrices)
    vocab: int
    kv: int  # key (= value) width: kv heads x head dim
    tied: bool = False  # input embedding shared with the output head
    context: int | None = None  # longest sequence the model takes
    experts: int = 0  # a mixture of experts: routed experts per layer (``ffn``: the width a token runs)
    expert_ffn: int = 0  # one expert's inner width

    @property
    def layer_params(self) -> int:
        mlp = self.experts * 3 * self.hidden * self.expert_ffn if self.experts else 3 * self.hidden * self.ffn
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv + mlp

    @property
    def expert_params(self) -> int:
        """Every expert's weights, in every layer (what expert parallelism shards)."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_ffn

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def activation_width(self) -> int:
        """Values one token keeps per layer when nothing is recomputed."""
        return 8 * self.hidden + 2 * self.kv + 4 * self.ffn


# Public shapes of common dense decoders (their config.json), for a model
# declared by parameter count alone: the nearest one stands in for it.
REFERENCE_SHAPES = {
    0.49e9: ModelShape(896, 24, 4864, 151936, 128, tied=True),  # Qwen2.5-0.5B
    1.54e9: ModelShape(1536, 28, 8960, 151936, 256, tied=True),  # Qwen2.5-1.5B
    3.09e9: ModelShape(2048, 36, 11008, 151936, 256, tied=True),  # Qwen2.5-3B
    7.62e9: ModelShape(3584, 28, 18944, 152064, 512),  # Qwen2.5-7B
    8.03e9: ModelShape(4096, 32, 14336, 128256, 1024),  # Llama-3.1-8B
    8.19e9: ModelShape(4096, 36, 12288, 151936, 1024),  # Qwen3-8B
    14.8e9: ModelShape(5120, 48, 13824, 152064, 1024),  # Qwen2.5-14B
    32.8e9: ModelShape(5120, 64, 27648, 152064, 1024),  # Qwen2.5-32B
    70.6e9: ModelShape(8192, 80, 28672, 128256, 1024),  # Llama-3.1-70B
    72.7e9: ModelShape(8192, 80, 29568, 152064, 1024),  # Qwen2.5-72B
}


def nearest_shape(params: float) -> ModelShape:
    """The reference shape whose parameter count is closest in ratio."""
    return REFERENCE_SHAPES[min(REFERENCE_SHAPES, key=lambda n: abs(log(max(params, 1.0) / n)))]


def shape_from_hf_config(cfg: dict) -> ModelShape:
    """A Hugging Face config.json (a multimodal one's text model). Raises
    KeyError, TypeError, ValueError or ZeroDivisionError on a malformed one."""
    cfg = cfg.get("text_config", cfg)
    hidden, heads = int(cfg["hidden_size"]), int(cfg.get("num_attention_heads", 1))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    ffn = int(cfg.get("intermediate_size", 4 * hidden))
    experts = hf_expert_count(cfg)
    expert_ffn = int(cfg.get("moe_intermediate_size") or ffn) if experts else 0
    if experts and cfg.get("num_experts_per_tok"):  # the experts a token runs
        ffn = expert_ffn * int(cfg["num_experts_per_tok"])
    context = cfg.get("max_position_embeddings")
    shape = ModelShape(hidden, int(cfg["num_hidden_layers"]), ffn, int(cfg["vocab_size"]),
                       int(cfg.get("num_key_value_heads", heads)) * head_dim,
                       bool(cfg.get("tie_word_embeddings", False)), int(context) if context else None,
                       experts, expert_ffn)
    if min(shape.hidden, shape.layers, shape.ffn, shape.vocab, shape.kv) <= 0:
        raise ValueError("a model dimension is not positive")
    return shape


@dataclass(frozen=True)
class StageMemory:
    """One stage's peak on one of its GPUs, how it splits, and what stays
    on the GPU while the stage sleeps so a colocated one can run."""

    phase: str  # "train step", "weight sync", "forward", "generation"
    parts: tuple[tuple[str, float], ...]  # (what, bytes)
    sleeps: bool  # gives its GPU memory back when idle (sleep, offload)
    concurrent: bool = False  # runs at any time beside the others (a logprob stage): never takes turns

    @property
    def total(self) -> float:
        return sum(b for _, b in self.parts)

    @property
    def takes_turns(self) -> bool:
        """Asleep while another stage on its GPUs runs."""
        return self.sleeps and not self.concurrent

    @property
    def asleep(self) -> float:
        """What it holds during the other stages' phases."""
        return 0.0 if self.takes_turns else self.total


def _peak(phases: list[tuple[str, list[tuple[str, float]]]], sleeps: bool) -> StageMemory:
    phase, parts = max(phases, key=lambda p: sum(b for _, b in p[1]))
    return StageMemory(phase, tuple((what, b) for what, b in parts if b > 0), sleeps)


def bucket_bytes(bucket: float, params: float, c: int) -> float:
    """Two export buckets in flight, none larger than the whole model."""
    return 2 * min(bucket, params * c)


def activation_bytes(shape: ModelShape, tokens: int, c: int, checkpointed: bool, split: int = 1) -> float:
    """A training microbatch's activations on one rank (module docstring)."""
    layers_kept = 1 if checkpointed else shape.layers
    kept_inputs = shape.layers * shape.hidden * tokens * c if checkpointed else 0
    per_layer = tokens * shape.activation_width * c
    logits = tokens * shape.vocab * LOGIT_BYTES
    return (kept_inputs + layers_kept * per_layer + logits) / split


def forward_bytes(shape: ModelShape, tokens: int, c: int, split: int = 1, sliced: bool = False) -> float:
    """A forward without gradients: one layer's activations and the logits,
    log-softmaxed whole in fp32 or, ``sliced``, a slice at a time (module
    docstring)."""
    if sliced:
        copies = 2 if c < LOGIT_BYTES else 1  # the slice's upcast (none in fp32) and its log-softmax
        logits = tokens * shape.vocab * c + copies * min(tokens, LOGPROB_SLICE_TOKENS) * shape.vocab * LOGIT_BYTES
    else:
        logits = tokens * shape.vocab * LOGIT_BYTES
    return (tokens * shape.activation_width * c + logits) / split


def fsdp_trainer(params: float, shape: ModelShape, c: int, shard: int, tokens: int | None,
                 bucket: float, sleeps: bool, trained: float | None = None) -> StageMemory:
    """FSDP2 with reshard_after_forward: fp32 master shards, fp32 gradient
    shards (reduce-scattered), AdamW m and v shards, each / the shard group;
    during a step also the layers in flight and the root unit (embedding and
    head, gathered from forward to backward) in the compute dtype. With
    LoRA, gradients, optimizer state and pushes are the ``trained`` adapters'."""
    shard = max(1, shard)
    trained = params if trained is None else trained
    master, grads, optimizer = params * 4 / shard, trained * 4 / shard, trained * 8 / shard
    gathered = (FSDP_LAYERS_IN_FLIGHT * shape.layer_params + shape.embedding_params) * c
    acts = activation_bytes(shape, tokens, c, CHECKPOINTS_ACTIVATIONS["fsdp"]) if tokens else 0.0
    step = [("params", master), ("gathered layers", gathered), ("grads", grads), ("optimizer", optimizer),
            ("activations", acts)]
    sync = [("params", master), ("optimizer", optimizer), ("buckets", bucket_bytes(bucket, trained, c))]
    return _peak([("train step", step), ("weight sync", sync)], sleeps)


def largest_tensor(shape: ModelShape) -> int:
    """Elements of the largest weight megatron holds whole: the embedding or output table, the fused
    gate/up projection (`linear_fc1`) or the fused q/k/v (`linear_qkv`)."""
    return max(shape.vocab * shape.hidden, 2 * shape.ffn * shape.hidden, shape.hidden * (shape.hidden + 2 * shape.kv))


def megatron_sync_bytes(shape: ModelShape, c: int, tp: int, pp: int) -> float:
    """What a megatron weight sync adds on the GPU besides its buckets: one weight at a time, gathered whole
    over tensor parallelism (its tp shards and the merged copy: two of the largest), relayed to the first
    pipeline stage (one more)."""
    copies = (2 if tp > 1 else 0) + (1 if pp > 1 else 0)
    return copies * largest_tensor(shape) * c


def megatron_rank_params(params: float, shape: ModelShape, tp: int, pp: int, dp: int = 1, ep: int = 1,
                         etp: int | None = None, over_dp: bool = False) -> float:
    """Parameters one megatron rank holds: the dense ones / (tp x pp), a
    mixture of experts' expert weights / (etp x ep x pp) (``etp`` left out is
    ``tp``). ``over_dp``: what the distributed optimizer keeps, also / the
    data-parallel size of each (dp for the dense ones; for the experts the
    ranks holding the same ones, tp x pp x dp / (etp x ep x pp))."""
    experts = min(float(shape.expert_params), params)
    dense_split, expert_split = max(1, tp * pp), max(1, (etp or tp) * ep * pp)
    dense_dp, expert_dp = (max(1, dp), max(1, tp * pp * max(1, dp) // expert_split)) if over_dp else (1, 1)
    return (params - experts) / dense_split / dense_dp + experts / expert_split / expert_dp


def megatron_trainer(params: float, shape: ModelShape, c: int, tp: int, pp: int, dp: int, distributed: bool,
                     tokens: int | None, sleeps: bool, ep: int = 1, etp: int | None = None,
                     bucket: float = 0.0) -> StageMemory:
    """Weights and fp32 gradient buffers / (tp x pp); AdamW state (with the
    fp32 master copy unless the weights are fp32) also / dp with the
    distributed optimizer. The gradient buffer stays allocated between steps.
    A weight sync gathers one weight at a time (``megatron_sync_bytes``) into
    buckets of ``bucket`` bytes, two in flight, on the GPU when a push
    streams rank to rank (counted always: in host memory where the object
    store keeps a copy).
    A mixture of experts' experts are split by expert parallelism instead
    (``megatron_rank_params``)."""
    held = megatron_rank_params(params, shape, tp, pp, dp, ep, etp)
    weights, grads = held * c, held * 4
    optimizer = megatron_rank_params(params, shape, tp, pp, dp, ep, etp, over_dp=distributed) * (12 if c < 4 else 8)
    acts = activation_bytes(shape, tokens, c, CHECKPOINTS_ACTIVATIONS["megatron"], split=max(1, tp)) if tokens else 0.0
    state = [("params", weights), ("grads", grads), ("optimizer", optimizer)]
    return _peak([("train step", state + [("activations", acts)]),
                  ("weight sync", state + [("gathered weight", megatron_sync_bytes(shape, c, tp, pp))]
                   + ([("buckets", bucket_bytes(bucket, params, c))] if bucket else []))], sleeps)


def torch_trainer(params: float, shape: ModelShape, c: int, tokens: int | None, bucket: float,
                  sleeps: bool, trained: float | None = None) -> StageMemory:
    """Unsharded: weights, fp32 gradients, AdamW state (with the fp32 master
    copy unless the weights are fp32) and every layer's activations. With
    LoRA, gradients, optimizer state and pushes are the ``trained`` adapter
    parameters' only (activations stay: gradients flow through every layer)."""
    trained = params if trained is None else trained
    weights, grads, optimizer = params * c, trained * 4, trained * (12 if c < 4 else 8)
    acts = activation_bytes(shape, tokens, c, CHECKPOINTS_ACTIVATIONS["torch"]) if tokens else 0.0
    return _peak([("train step", [("params", weights), ("grads", grads), ("optimizer", optimizer),
                                  ("activations", acts)]),
                  ("weight sync", [("params", weights), ("optimizer", optimizer),
                                   ("buckets", bucket_bytes(bucket, trained, c))])],
                 sleeps)


# (inputs, outputs) of the linear layers LoRA adapters commonly go on, in units of the shape's widths
_LORA_LAYER_WIDTHS = {
    "q_proj": ("hidden", "hidden"), "k_proj": ("hidden", "kv"), "v_proj": ("hidden", "kv"),
    "o_proj": ("hidden", "hidden"), "gate_proj": ("hidden", "ffn"), "up_proj": ("hidden", "ffn"),
    "down_proj": ("ffn", "hidden"), "qkv": ("hidden", "qkv"), "c_attn": ("hidden", "qkv"),
    "out": ("hidden", "hidden"), "c_proj": ("hidden", "hidden"),
}


def lora_params(shape: ModelShape, rank: int, targets: list[str]) -> int:
    """Adapter parameters: rank x (inputs + outputs) of each targeted layer, in
    every layer (a name not known here counts as a hidden -> hidden layer)."""
    widths = {"hidden": shape.hidden, "kv": shape.kv, "ffn": shape.ffn, "qkv": shape.hidden + 2 * shape.kv}
    per_layer = sum(widths[a] + widths[b] for a, b in (_LORA_LAYER_WIDTHS.get(t, ("hidden", "hidden"))
                                                       for t in targets))
    return rank * per_layer * shape.layers


def logprob_stage(params: float, shape: ModelShape, c: int, split: int, tokens: int | None,
                  sleeps: bool, sliced: bool = False, rank_params: float | None = None) -> StageMemory:
    """Scoring: the weights (/ tp x pp, or ``rank_params`` of them) and one forward's activations."""
    split = max(1, split)
    acts = forward_bytes(shape, tokens, c, split, sliced) if tokens else 0.0
    held = params / split if rank_params is None else rank_params
    return _peak([("forward", [("params", held * c), ("activations", acts)])], sleeps)


def fsdp_logprob(params: float, shape: ModelShape, c: int, shard: int, tokens: int | None,
                 sleeps: bool, sliced: bool = True) -> StageMemory:
    """A sharded forward-only copy: the compute-dtype shards (/ the shard
    group) and, during a forward, the layers in flight and the root unit
    (embedding and head) gathered, and one forward's activations."""
    shard = max(1, shard)
    gathered = (FSDP_LAYERS_IN_FLIGHT * shape.layer_params + shape.embedding_params) * c
    acts = forward_bytes(shape, tokens, c, sliced=sliced) if tokens else 0.0
    return _peak([("forward", [("params", params * c / shard), ("gathered layers", gathered),
                               ("activations", acts)])], sleeps)


def reserving_generator(params: float, c: int, split: int, share: float, capacity: float | None,
                        sleeps: bool) -> StageMemory:
    """vLLM and SGLang reserve their share of each GPU up front (weights, KV
    cache, graphs inside it); without a GPU size only the weights are known."""
    weights = params * c / max(1, split)
    reserved = max(weights, share * capacity) if capacity else weights
    return _peak([("generation", [("reserved share" if capacity else "params", reserved)])], sleeps)


def torch_generator(params: float, shape: ModelShape, c: int, rows: int | None, row_tokens: int | None,
                    sleeps: bool, adapters: int = 0) -> StageMemory:
    """The weights, LoRA adapters (``adapters`` parameters: those of every pipeline it serves) and the KV
    cache of the rows it decodes at once (k and v per layer)."""
    kv_cache = 2 * shape.layers * shape.kv * c * rows * row_tokens if rows and row_tokens else 0.0
    parts = [("params", params * c)] + ([("adapters", adapters * c)] if adapters else []) + [("kv cache", kv_cache)]
    return _peak([("generation", parts)], sleeps)
