"""megatron-core models for the megatron engines: process groups, a GPTModel
from a Llama-style shape, and Hugging Face weights in and out. The rows a
forward takes, and their log-probabilities: ``rows.py``.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

# Re-exported: the engines and tests open checkpoints through this module.
from rldsl.models.hf_checkpoint import open_hf_weights, read_hf_config, read_hf_weights  # noqa: F401
from rldsl.runtime.engines.megatron.hf_weights import (
    LlamaShape,
    as_hf_tensors,
    is_expert_weight,
    megatron_tensor_to_hf,
    merge_tensor_parallel,
    split_for_tensor_parallel,
    tensor_parallel_kind,
    tensor_parallel_shards,
    unconverted,
    with_expert_offset,
    with_layer_offset,
)
from rldsl.runtime.engines.megatron.experts import (
    allow_router_without_transformer_engine,
    expert_offset,
    expert_tensor_parallel,
    gather_experts,
    moe_config_fields,
    with_sequence_parallel_norms,
)
from rldsl.runtime.engines.torch.common import init_one_process_group

log = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Per-layer activation checkpointing (what the compiler's memory model assumes of the trainer).
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


# -- process groups ---------------------------------------------------------------


def ensure_model_parallel(tp: int, pp: int, seed: int, ep: int = 1, etp: int | None = None) -> None:
    """Initialise torch.distributed (a one-process group if nobody did) and
    Megatron's tensor/pipeline/expert/data-parallel groups, once per process
    (``etp``: the ranks each expert splits over; None: ``tp``)."""
    from megatron.core import parallel_state, tensor_parallel

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        init_one_process_group(backend)
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_expert_tensor_parallel_world_size())
        if current != (tp, pp, ep, etp or tp):
            raise RuntimeError(f"Megatron groups already initialised with (tp, pp, ep, etp) = {current}, not "
                               f"{(tp, pp, ep, etp or tp)}")
        return
    for name, group in (("tp x pp", tp * pp), ("etp x ep x pp", (etp or tp) * ep * pp)):
        if dist.get_world_size() % group:
            raise ValueError(f"world size {dist.get_world_size()} is not a multiple of {name} = {group}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    _form_export_groups()


# The export's gathers and relays run on process groups of their own (the same ranks as Megatron's
# tensor- and pipeline-parallel groups), so an export may run beside a step's calls on another thread:
# two threads' collectives on one group could pair one rank's gather with another's all-reduce.
_EXPORT_GROUPS: dict[tuple[int, ...], object] = {}


def _form_export_groups() -> None:
    """A twin of this process's tensor- and pipeline-parallel groups, and of
    every other rank's (``new_group`` is a collective of the whole world:
    every rank creates every group, in the same order)."""
    from megatron.core import parallel_state

    if dist.get_world_size() == 1:
        return
    own = [tuple(dist.get_process_group_ranks(group)) for group in
           (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_pipeline_model_parallel_group(),
            parallel_state.get_expert_model_parallel_group(), parallel_state.get_expert_tensor_parallel_group())]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own)
    for ranks in sorted({ranks for groups in everyone for ranks in groups if len(ranks) > 1} - set(_EXPORT_GROUPS)):
        _EXPORT_GROUPS[ranks] = dist.new_group(list(ranks))


def export_group(group):
    """The export's twin of Megatron's ``group`` (made with it by ``ensure_model_parallel``, the one place
    Megatron's groups are made); a one-rank group is its own: nothing to pair."""
    if group is None or dist.get_world_size(group) == 1:
        return group
    return _EXPORT_GROUPS[tuple(dist.get_process_group_ranks(group))]


def compute_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# -- the model ---------------------------------------------------------------------


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def transformer_config(shape: LlamaShape, dtype: str = "bf16", tp: int = 1, pp: int = 1,
                       recompute_layers: bool = False, ep: int = 1, etp: int | None = None):
    """A Llama-style ``TransformerConfig``. ``calculate_per_token_loss`` makes
    DDP reduce gradients with a plain sum (no 1/dp factor): the split step
    divides by the global token or sequence count itself. ``recompute_layers``
    (the trainer's) checkpoints every layer: full uniform recompute, one layer
    a unit, so a forward keeps each layer's input and the backward rebuilds
    one layer's activations at a time (about one extra forward a step)."""
    from megatron.core.transformer import TransformerConfig

    if shape.vocab_size % tp:
        raise ValueError(f"vocab size {shape.vocab_size} does not split over tp = {tp}")
    if shape.num_kv_heads % tp:
        raise ValueError(f"{shape.num_kv_heads} key/value heads do not split over tp = {tp}")
    params_dtype = DTYPES[dtype]
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        # megatron-core trains MoE layers under tensor parallelism only with the sequence split over tp too
        sequence_parallel=bool(shape.num_experts) and tp > 1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,  # the dtype of activations sent between pipeline stages
        bf16=params_dtype is torch.bfloat16,
        fp16=params_dtype is torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        calculate_per_token_loss=True,
        **(FULL_RECOMPUTE if recompute_layers else {}),
        **moe_config_fields(shape, ep, etp or tp),
    )


def build_gpt_model(shape: LlamaShape, config):
    """This pipeline stage's GPTModel, on the compute device."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs

    layers = dict(num_experts=shape.num_experts or None, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm)
    if transformer_engine_available():
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**layers)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **layers)
        if config.sequence_parallel:
            spec = with_sequence_parallel_norms(spec, config)
    if shape.num_experts:
        allow_router_without_transformer_engine()
    model = GPTModel(
        config,
        spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_positions,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        **({"rope_scaling": True, "rope_scaling_factor": shape.rope_scaling_factor}
           if shape.rope_scaling_factor else {}),
    )
    return model.to(compute_device())


def uses_fused_norms() -> bool:
    """Transformer Engine layers hold the norm weights inside the linears."""
    return transformer_engine_available()


def layer_offset(model) -> int:
    """The global index of this pipeline stage's first layer."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def local_weights(model, shape: LlamaShape) -> dict[str, torch.Tensor]:
    """This rank's weights under global (pipeline- and expert-parallel-independent) Megatron names."""
    return {name: tensor for name, tensor in _load_targets(model, shape).items() if tensor is not None}


# -- Hugging Face weights in ----------------------------------------------------------


def load_hf_weights(model, hf: Mapping[str, torch.Tensor], shape: LlamaShape) -> None:
    """Copy this rank's shard of Hugging Face weights into ``model``, reading
    only its pipeline stage's tensors and, of those, its tensor-parallel
    slices (from a checkpoint opened by ``open_hf_weights``, nothing more
    leaves the files)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    source, targets = as_hf_tensors(hf), _load_targets(model, shape)
    if extra := unconverted(source, shape):
        raise ValueError(f"{len(extra)} Hugging Face weights have no place in the megatron model, e.g. "
                         f"{extra[:3]}: a layout this conversion does not know; train the model with the fsdp engine")
    experts = {name for name in targets if is_expert_weight(name)}
    _copy_shards(targets, tensor_parallel_shards(source, shape, tp, tp_rank, targets.keys() - experts,
                                                 uses_fused_norms()))
    if experts:
        _copy_shards(targets, tensor_parallel_shards(source, shape, *expert_tensor_parallel(), experts))
    log.info("tensor-parallel rank %d of pipeline stage %d read %.1f MB of Hugging Face weights", tp_rank,
             parallel_state.get_pipeline_model_parallel_rank(), source.bytes_read / 1e6)


def load_megatron_weights(model, full: Mapping[str, torch.Tensor], shape: LlamaShape) -> None:
    """Copy full (unsharded, globally named) Megatron tensors into this rank's shard."""
    from megatron.core import parallel_state

    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    targets = _load_targets(model, shape)
    if "output_layer.weight" in targets and "output_layer.weight" not in full:
        # Tied embeddings on a last pipeline stage: its output layer is a copy of the embedding.
        full = {**full, "output_layer.weight": full["embedding.word_embeddings.weight"]}
    etp, etp_rank = expert_tensor_parallel()

    def shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
        size, rank = (etp, etp_rank) if is_expert_weight(name) else (tp, tp_rank)
        return split_for_tensor_parallel(name, tensor, size)[rank]

    _copy_shards(targets, ((name, shard(name, tensor))
                           for name, tensor in full.items() if name in targets))  # others: another stage's


def _load_targets(model, shape: LlamaShape) -> dict[str, torch.Tensor]:
    """This rank's weights under global names, to be written in place."""
    layers, experts = layer_offset(model), expert_offset(shape)
    return {with_expert_offset(with_layer_offset(name, layers), experts): tensor
            for name, tensor in model.state_dict().items() if not name.endswith("_extra_state")}


def _copy_shards(targets: Mapping[str, torch.Tensor], shards: Iterable[tuple[str, torch.Tensor]]) -> None:
    with torch.no_grad():
        for name, shard in shards:
            if shard.shape != targets[name].shape:
                raise ValueError(f"{name}: shard {tuple(shard.shape)} != model {tuple(targets[name].shape)}")
            targets[name].copy_(shard)


# -- Hugging Face weights out ----------------------------------------------------------


def export_hf_weights(model, shape: LlamaShape, on_host: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Full Hugging Face tensors, in a fixed order: on CPU, or without
    ``on_host`` where they were gathered (a tensor no rank split may then be
    a view of the parameter, valid until the next optimizer step).

    A collective: every rank of the tensor- and pipeline-parallel groups must
    iterate it to the end. Only the first tensor- and pipeline-parallel rank
    yields anything; the others only take part in the gathers, which run on
    the export's own groups (``export_group``): it may run beside a step.
    """
    from megatron.core import parallel_state

    tp_group = export_group(parallel_state.get_tensor_model_parallel_group())
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_group = export_group(parallel_state.get_pipeline_model_parallel_group())
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    exporting = tp_rank == 0 and parallel_state.get_pipeline_model_parallel_rank() == 0
    expert_groups = (export_group(parallel_state.get_expert_tensor_parallel_group()),
                     export_group(parallel_state.get_expert_model_parallel_group()))
    fused = uses_fused_norms()
    for stage in range(pp_size):
        for name, tensor in _stage_weights(model, shape, stage, (tp_group, expert_groups, pp_group), pp_size,
                                           tp_rank == 0):
            if exporting and not (shape.tied_embeddings and name == "output_layer.weight"):
                yield from megatron_tensor_to_hf(name, tensor.cpu() if on_host else tensor, shape, fused).items()


def _stage_weights(model, shape, stage, groups, pp_size, relay) -> Iterator[tuple[str, torch.Tensor]]:
    """Pipeline stage ``stage``'s full tensors one at a time: each gathered
    over tensor parallelism (an expert's, then over expert parallelism: the
    same expert of every rank) and (on the first tensor-parallel rank)
    broadcast to every stage, then yielded before the next is gathered, so a
    rank holds one full tensor (ep of them for an expert) beyond its shards."""
    from megatron.core import parallel_state

    tp_group, (etp_group, ep_group), pp_group = groups
    here = parallel_state.get_pipeline_model_parallel_rank() == stage
    gathered = (pair for name, whole in _gather_tensor_parallel(local_weights(model, shape), tp_group, etp_group)
                for pair in gather_experts(name, whole, shape, ep_group)) if here else iter(())
    if pp_size == 1:
        yield from gathered
        return
    if not relay:
        for _ in gathered:  # its part of each tensor-parallel gather; another rank relays the stage
            pass
        return
    source = dist.get_process_group_ranks(pp_group)[stage]
    while True:
        name, tensor = next(gathered, (None, None)) if here else (None, None)
        header = [(name, tuple(tensor.shape), tensor.dtype) if name is not None else None]
        dist.broadcast_object_list(header, src=source, group=pp_group)
        if header[0] is None:  # the stage's tensors are all sent
            return
        name, size, dtype = header[0]
        tensor = tensor if here else torch.empty(size, dtype=dtype, device=compute_device())
        dist.broadcast(tensor, src=source, group=pp_group)
        yield name, tensor


def _gather_tensor_parallel(weights: Mapping[str, torch.Tensor], tp_group,
                            etp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each weight whole, gathered over the tensor-parallel group (an
    expert's over the expert-tensor-parallel one) as it is asked for."""
    for name, tensor in weights.items():
        group = etp_group if etp_group is not None and is_expert_weight(name) else tp_group
        size = dist.get_world_size(group)
        if size == 1 or tensor_parallel_kind(name) == "replicated":
            yield name, tensor.detach()
            continue
        shards = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(shards, tensor.detach().contiguous(), group=group)
        yield name, merge_tensor_parallel(name, shards)
        del shards
