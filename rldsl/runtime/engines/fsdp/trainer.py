"""``FsdpTrainer``: the split-step trainer over FSDP2-sharded parameters.

The protocol and its arithmetic are the torch engine's (``TorchTrainer``,
whose docstring explains why an optimizer step equals one backward over its
whole global mini-batch); what changes is where parameters and gradients
live and when the forwards run:

- the model is sharded as it is built (``loading.py``): parameters on meta,
  ``fully_shard``, then each rank allocates and fills only its fp32 shards;
- every forward all-gathers one FSDP unit (layer) at a time and frees it
  after its forward and again after its backward; every backward
  reduce-scatters the unit's gradients into the fp32 sharded ``.grad``
  (summed over ranks: divide factor 1), so no rank keeps full parameters or
  full gradients between forwards;
- every layer checkpoints its activations (``sharding.checkpoint_activations``):
  a forward keeps each layer's input, and a layer's backward first reruns its
  forward on the parameters gathered for that backward;
- those per-layer collectives need every rank to run the same number of
  forwards, but the controller streams microbatches to ranks as prompt
  groups arrive, so ranks see different numbers of them (and of forwards:
  token budgets, an idle rank). ``train_microbatch`` therefore only keeps
  the rows (token ids and per-token floats: host memory) and returns the
  counts it can read off the masks. At the mini-batch boundary
  (``optimizer_step`` / ``finish_train_step``, which every rank calls) the
  ranks agree on the largest number of pending forwards (an all-reduce MAX)
  and each runs exactly that many forward + backward passes, the missing
  ones a one-token forward with a zero backward, so collectives line up.
  Then, as in the torch engine: the counts are all-reduced (global N), the
  sharded gradients divided by N, clipped (the norm is global over the
  shards), and AdamW steps on the shards. The loss statistics of the
  mini-batch come back from that boundary call.
- the proximal pass (``TorchTrainer``'s docstring) runs at the boundaries
  too: a held boundary computes the pending microbatches' proximal logprobs
  in lockstep no-grad forwards, and finish trains the held mini-batches in
  lockstep forwards + backwards.

``shard`` is the number of ranks a parameter is split over: 0 (or the rank
count) shards over all ranks; a divisor ``s`` of the ranks is hybrid
sharding (HSDP) over a (ranks/s, s) mesh: each group of ``s`` ranks holds
one copy, and gradients are also all-reduced across the groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rldsl.models.lora import has_adapters, is_adapter
from rldsl.runtime.engines.fsdp.loading import build_sharded
from rldsl.runtime.engines.fsdp.sharding import DTYPES, build_mesh, ensure_process_group, reshard_all, training_device
from rldsl.runtime.engines.fsdp.state import full_state_buckets, load_checkpoint, save_checkpoint
from rldsl.runtime.engines.torch.offload import Offloaded
from rldsl.runtime.engines.policy_loss import PER_FORWARD_AGGREGATIONS, merge_stats
from rldsl.runtime.engines.torch.packing import concat_rows, forward_rows, take_rows
from rldsl.runtime.engines.torch.train import TorchTrainer
from rldsl.runtime.protocols import Batch, trained_tokens


class FsdpTrainer(TorchTrainer):
    # An export may run beside the next step's microbatches: they only keep rows, and the forwards run at
    # the mini-batch boundaries, which wait for it (runtime/control/exports.py). A checkpoint, which gathers
    # over the same group, waits for the export instead (TrainerWorker).
    exports_beside_steps = True
    checkpoints_beside_exports = False

    def __init__(self, model, shard: int = 0, dtype: str = "fp32", offload: bool = True, process_group=None,
                 **options):
        device = training_device()
        ensure_process_group(device)
        self.mesh = build_mesh(process_group, shard, device.type)
        build_sharded(model, self.mesh, dtype, device)
        self.dtype = dtype
        self.offload = offload
        self.offloaded = Offloaded()
        self._pending: list[Batch] = []  # microbatches kept for the boundary's lockstep forwards
        super().__init__(model, process_group=process_group, **options)

    # -- the split-step protocol (forwards deferred to the mini-batch boundary) --

    def begin_train_step(self, step: int) -> None:
        self._require_awake("begin_train_step")
        super().begin_train_step(step)
        self._pending = []

    def train_microbatch(self, step: int, batch: Batch) -> dict[str, float]:
        """Keeps the rows for the boundary's forwards; returns the microbatch's
        token and sequence counts (the loss statistics come from the
        boundary's ``optimizer_step`` / ``finish_train_step``)."""
        self._require_awake("train_microbatch")
        self._require_open(step, "train_microbatch")
        self._pending.append({name: value.clone() if torch.is_tensor(value) else value
                              for name, value in batch.items()})
        tokens_per_row = torch.as_tensor(trained_tokens(batch)).sum(dim=1)
        return {"tokens": float(tokens_per_row.sum()), "sequences": float((tokens_per_row > 0).sum())}

    def abort_train_step(self, step: int) -> None:
        self._pending = []
        super().abort_train_step(step)
        reshard_all(self.model.module)  # a forward that failed half way may have left a unit gathered

    def weight_buckets(self, bucket_bytes: int, on_host: bool = True):
        """Full (unsharded) tensors under the torch engine's (Hugging Face)
        names in the compute dtype (the values the forwards use): CPU
        copies, or without ``on_host`` gathered where the shards are, for a
        rank-to-rank push. A collective: every rank iterates it; only the
        first rank yields buckets."""
        self._require_awake("weight_buckets")
        only = is_adapter if has_adapters(self.model.module) else None  # LoRA: the adapters alone
        return full_state_buckets(self.model.module, bucket_bytes, DTYPES[self.dtype], only, on_host)

    # -- checkpoints and offload -------------------------------------------------

    def save_checkpoint(self, directory) -> None:
        """Each rank writes its shards of the model and optimizer state under
        ``directory/fsdp/``, rank 0 the version and optimizer steps
        (fsdp/state.py). A collective."""
        self._require_idle("save_checkpoint")
        save_checkpoint(directory, self.model.module, self.optimizer,
                        {"version": self.version, "optimizer_steps": self.optimizer_steps})

    def load_checkpoint(self, directory) -> int:
        """Every rank reads the pieces its shards cover (any rank count or
        ``shard`` may load it); returns the version."""
        self._require_idle("load_checkpoint")
        counters = load_checkpoint(directory, self.model.module, self.optimizer)
        self.version = counters["version"]
        self.optimizer_steps = counters.get("optimizer_steps", 0)
        return self.version

    # -- helpers -----------------------------------------------------------------

    def _take_optimizer_step(self) -> dict[str, float] | None:
        self._train_pending_in_lockstep()
        return super()._take_optimizer_step()

    def _train_pending_in_lockstep(self) -> None:
        self._in_lockstep(self._take_pending_forwards(), self._forward_backward)

    def _train_pending(self) -> None:
        self._train_pending_in_lockstep()

    def _keep_pending_with_proximal(self) -> None:
        kept: list = []
        self._in_lockstep(self._take_pending_forwards(),
                          lambda rows: kept.append((rows, self._proximal_logprobs(rows))) if rows is not None
                          else self._empty_forward(grad=False))
        self._deferred[-1] += kept

    def _train_forwards(self, forwards) -> None:
        self._in_lockstep(forwards, lambda item: self._forward_backward(*(item or (None,))))

    def _take_pending_forwards(self) -> list[Batch]:
        """The forwards of the pending microbatches: each one's rows in forwards of its own; with a mean
        per forward (``micro_token_mean``) the rank's rows together, so a forward holds ``micro_batch``
        rows of the mini-batch whatever the prompt groups, as verl's micro-batches do."""
        pending, self._pending = self._pending, []
        if self.loss.agg in PER_FORWARD_AGGREGATIONS and pending:
            pending = [concat_rows(pending)]
        return [take_rows(batch, rows) for batch in pending
                for rows in forward_rows(batch, self.rows_per_forward, self.tokens_per_forward)]

    def _in_lockstep(self, items: list, run) -> None:
        """Every rank runs ``run`` the same number of times: on each of its own
        items, then on None up to the largest count of any rank (agreed by an
        all-reduce MAX over the trainer's ranks), so the per-layer collectives
        line up."""
        count = torch.tensor([len(items)], dtype=torch.int64)
        if self._data_parallel():
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.process_group)
        for index in range(int(count)):
            run(items[index] if index < len(items) else None)

    def _forward_backward(self, batch: Batch | None, proximal: torch.Tensor | None = None) -> None:
        """One forward and backward of ``batch``'s un-normalised loss sum,
        adding its statistics to the mini-batch's sums; an empty forward when
        there is nothing to learn from, so the collectives still run."""
        if batch is not None:
            result = self._loss_sums(batch, proximal)
            merge_stats(self._sums, {"loss_sum": float(result.loss_sum.detach()), **result.stats})
            if result.loss_sum.requires_grad:
                result.loss_sum.backward()
                return
        self._empty_forward()

    def _empty_forward(self, grad: bool = True) -> None:
        """A one-token forward and (with ``grad``) a backward of zero times its
        logits: the same all-gathers and reduce-scatters as a real forward,
        adding exact zeros to the gradients."""
        token = torch.zeros((1, 1), dtype=torch.long, device=self.model.device)
        with torch.set_grad_enabled(grad):
            logits, _ = self.model.forward(token, None, token, use_cache=False)
        if grad:
            (logits.float().sum() * 0.0).backward()

    def _reduce_and_scale_grads(self, count: float) -> None:
        """Each backward already reduce-scattered its gradients into the
        shards (summed over ranks); only the division by N is left."""
        for param in self.parameters:
            if param.grad is None:  # unused by every forward: AdamW still steps it, as in the torch engine
                param.grad = torch.zeros_like(param)
            else:
                param.grad.div_(count)

    def _clip(self) -> float:
        norm_limit = self.max_grad_norm if self.max_grad_norm else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, norm_limit)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
