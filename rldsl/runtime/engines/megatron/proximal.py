"""The megatron trainer's proximal pass.

A loss with ``behaviour_cap`` or a ``correction`` weighs each token by
pi_prox / pi_behaviour, the proximal policy being the weights the rollout
batch started with (``TorchTrainer``'s docstring). With one optimizer step
per rollout batch those are the weights of every forward. With several:

- the first ``optimizer_step`` is held: its mini-batch's gradients wait in
  DDP's grad buffers and its sums are set aside, so the weights stay the
  batch-start ones;
- every later ``train_microbatch`` is cut into the pipeline microbatches the
  training pass will use (same rows, same padding) and run through
  Megatron's forward-only schedule, no grad, on those weights: with pp > 1
  every stage of the replica takes part and the last one gets the proximal
  logprobs of each pipeline microbatch; the rows (host memory) are kept with
  them (earlier stages keep the rows alone: they only relay activations);
- ``finish_train_step`` takes the held optimizer step, then trains each
  later mini-batch, call by call as it arrived, against its kept logprobs,
  one optimizer step each.

Under expert parallelism (``ExpertLockstep``) every proximal forward is a
round of its own, as a training forward is: the first held boundary first
joins the mini-batch's training rounds (empty training forwards), and each
later boundary, and finish before it trains, joins the proximal rounds with
empty forward-only ones, so a rank's forward-only pass never meets
another's training forward in the experts' exchanges.

No grad also keeps the MoE routers from logging auxiliary losses for these
forwards. A later pass (``ppo_epochs``) sends the same rows again and gets
the same proximal logprobs. The cost: one forward-only pass per later row,
and training that waits for the rollout batch's last microbatch.
"""

from __future__ import annotations

import torch

from rldsl.runtime.engines.megatron import rows as mr
from rldsl.runtime.engines.megatron.logprob import logprob_forward_step
from rldsl.runtime.engines.megatron.open_step import HeldSteps
from rldsl.runtime.protocols import Batch

PROXIMAL = "proximal_logprobs"  # a pipeline microbatch's batch-start logprobs, kept with its rows
DEFERRED = {"deferred": 1.0}  # what a held optimizer step reports


class ProximalPass:
    """Mixed into ``MegatronTrainer``: uses its open step (``_open``), its
    chunking and packing, its schedule and its optimizer step."""

    def _hold_optimizer_step(self) -> dict[str, float]:
        """A mini-batch boundary whose optimizer step waits for finish."""
        if self._open.held is None:
            self._join_expert_rounds()  # the training forwards end here on every rank; proximal ones follow
            self._open.held = HeldSteps(*self._open.restart_sums())
        else:
            self._join_proximal_rounds()
            self._open.held.later.append([])
        return dict(DEFERRED)

    def _keep_with_proximal(self, chunks: list[Batch]) -> None:
        """Keep one call's pipeline microbatches, each with its proximal
        logprobs on the last pipeline stage."""
        if not chunks:
            return
        logprobs = self._proximal_logprobs(chunks)
        if logprobs is not None:
            chunks = [{**chunk, PROXIMAL: values} for chunk, values in zip(chunks, logprobs)]
        self._open.held.later[-1].append(chunks)

    @torch.no_grad()
    def _proximal_logprobs(self, chunks: list[Batch]) -> list[torch.Tensor] | None:
        """Each chunk's response logprobs (CPU) on the current weights, through
        the schedule and shapes the training pass uses (under expert
        parallelism one forward a round, as training's); None off the last stage."""
        from megatron.core import parallel_state

        packed, length, rows = self._pack(chunks)
        outputs = []
        for some in ([[chunk] for chunk in packed] if self.lockstep.needed else [packed]):
            if self.lockstep.needed:
                self.lockstep.round(has_rows=True)
            outputs += mr.forward_only(self.model, some, length, rows, logprob_forward_step)
        if not parallel_state.is_pipeline_last_stage():
            return None
        return [output["logprobs"] for output in outputs]

    @torch.no_grad()
    def _join_proximal_rounds(self) -> None:
        """Empty forward-only rounds until no rank of the expert-parallel group has proximal rows."""
        if self.lockstep.needed:
            empty = [mr.empty_round(self.device)]
            self.lockstep.join_rounds(lambda: mr.forward_only(self.model, empty, 1, 1, mr.empty_forward_step))

    def _take_held_optimizer_steps(self) -> dict[str, float] | None:
        """The first mini-batch's optimizer step, then each later mini-batch
        trained against its proximal logprobs and stepped; the last attempt."""
        self._join_proximal_rounds()
        open_step = self._open
        held, open_step.held = open_step.held, None
        open_step.sums, open_step.pipeline_microbatches = held.sums, held.pipeline_microbatches
        attempt = self._take_optimizer_step()
        for calls in held.later:
            self._zero_grads()
            for chunks in calls:
                self._train_chunks(chunks)
            attempt = self._take_optimizer_step()
        return attempt
