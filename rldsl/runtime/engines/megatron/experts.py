"""A mixture of experts on megatron-core: the config, the expert-parallel
names, the export's gather of every rank's experts, forwards in lockstep
over expert parallelism (``ExpertLockstep``) and the norms sequence
parallelism needs without Transformer Engine.

Expert parallelism (``ep``) gives each of its ranks a contiguous range of
each layer's experts: rank r holds global experts ``r * n/ep ... (r+1) * n/ep
- 1`` as its ``local_experts.0 ...``. Weights travel under global expert ids
(``hf_weights.with_expert_offset``), so loading reads only a rank's experts
and an export gathers the others'. Expert tensor parallelism (``etp``,
Megatron's default ``tp``) splits each expert's weights over ``etp`` ranks
as tensor parallelism splits the dense ones; with ``etp != tp`` over other
ranks (Megatron's expert-tensor-parallel group), so loads, exports and
checkpoints find an expert's shards by ``expert_tensor_parallel()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist

from rldsl.runtime.engines.megatron.hf_weights import LlamaShape, is_expert_weight, with_expert_offset

# `alltoall`: tokens travel to their experts' ranks and back (Megatron's choice for ep > 1);
# SequentialMLP experts (no grouped GEMM: it needs Transformer Engine or the grouped_gemm package)
MOE_DISPATCHER = "alltoall"


def moe_config_fields(shape: LlamaShape, ep: int, etp: int) -> dict:
    """The ``TransformerConfig`` fields of ``shape``'s experts ({} for a dense model).

    The router matches Hugging Face's Qwen3-MoE: a softmax over the chosen
    experts' logits equals its softmax over all, top k, renormalised
    (``norm_topk_prob``); without that renormalisation the softmax comes
    first (``moe_router_pre_softmax``). The load-balancing loss's weight is
    the config's ``router_aux_loss_coef`` when it trains with it."""
    if not shape.num_experts:
        if ep > 1:
            raise ValueError(f"ep = {ep}, but the model has no experts")
        return {}
    if shape.num_experts % ep:
        raise ValueError(f"{shape.num_experts} experts do not split over ep = {ep}")
    return dict(num_moe_experts=shape.num_experts, moe_router_topk=shape.router_topk,
                moe_ffn_hidden_size=shape.expert_ffn_hidden_size, moe_grouped_gemm=False,
                moe_token_dispatcher_type=MOE_DISPATCHER, moe_router_pre_softmax=not shape.norm_topk_prob,
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=shape.router_aux_loss,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def allow_router_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router GEMM reads a module global that only a
    Transformer Engine import binds (a NameError without TE, on any device);
    None selects its plain ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def expert_offset(shape: LlamaShape) -> int:
    """The global id of this rank's first expert (0 without expert parallelism)."""
    if not shape.num_experts:
        return 0
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (shape.num_experts // ep)


def expert_tensor_parallel() -> tuple[int, int]:
    """(size, this rank's place) of the group an expert's weights split over."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_tensor_parallel_world_size(), parallel_state.get_expert_tensor_parallel_rank()


def gather_experts(name: str, tensor: torch.Tensor, shape: LlamaShape, group) -> Iterator[tuple[str, torch.Tensor]]:
    """``name`` (a global name) and its tensor, or, for an expert's weight
    under expert parallelism, the same local expert of every rank of
    ``group``, each under its own global name. A collective of the group:
    every rank asks for its experts in the same order."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1 or not is_expert_weight(name):
        yield name, tensor
        return
    per_rank = shape.num_experts // size
    local = with_expert_offset(name, -expert_offset(shape))
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    for rank, part in enumerate(parts):
        yield with_expert_offset(local, rank * per_rank), part


class ExpertLockstep:
    """Forwards in lockstep over expert parallelism.

    Each MoE layer's forward and backward exchange tokens with every rank of
    the expert-parallel group (all-to-all), so those ranks must run the same
    number of forwards in a step; data-parallel ranks of a split step may
    hold different numbers of rows. Every forward is a round: the ranks first
    tell each other whether they have rows (one all-reduce), and before its
    optimizer step a rank whose rows are done keeps joining rounds with an
    empty forward (a zero loss: no gradient, the exchanges still made) until
    none of them has rows left."""

    def __init__(self, ep: int):
        from megatron.core import parallel_state

        self.group = parallel_state.get_expert_model_parallel_group() if ep > 1 else None

    @property
    def needed(self) -> bool:
        return self.group is not None

    def join_rounds(self, forward_empty) -> None:
        """Empty forwards (``forward_empty()``) until no rank has rows; nothing without expert parallelism."""
        while self.needed and self.round(has_rows=False):
            forward_empty()

    def round(self, has_rows: bool) -> bool:
        """A collective of the group: whether any rank has rows this round."""
        flag = torch.tensor([int(has_rows)], dtype=torch.int)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())


class SequenceParallelNorm:
    """megatron-core's local-spec norm (``WrappedTorchNorm``: torch's
    RMSNorm) for sequence parallelism, which that wrapper refuses: the same
    norm, its weight marked ``sequence_parallel`` so that ``finalize_model_grads``
    sums its gradient over the tensor-parallel ranks (each saw 1/tp of the
    positions), as Transformer Engine's norms are marked."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        for parameter in norm.parameters():
            parameter.sequence_parallel = True
        return norm


def with_sequence_parallel_norms(layer_spec, config):
    """The local spec's block with ``SequenceParallelNorm`` for every norm (the final one included)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    def swap(spec):
        if spec is WrappedTorchNorm:
            return SequenceParallelNorm
        if isinstance(spec, ModuleSpec) and dataclasses.is_dataclass(spec.submodules):
            fields = {f.name: swap(getattr(spec.submodules, f.name)) for f in dataclasses.fields(spec.submodules)}
            return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **fields))
        return spec

    layers = [swap(layer_spec)] * get_num_layers_to_build(config)
    return ModuleSpec(TransformerBlock, submodules=TransformerBlockSubmodules(layer_specs=layers,
                                                                             layer_norm=SequenceParallelNorm))
