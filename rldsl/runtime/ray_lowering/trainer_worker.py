"""The trainer's worker: one data-parallel rank of the split-step trainer,
its weight exports (object store or a collective push) and its checkpoints.

A plain class like the other stage workers (workers.py); the launcher turns
it into a Ray actor.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Sequence

from rldsl.plan import receives_weights, recomputes_at_batch_start
from rldsl.runtime import protocols as p
from rldsl.runtime.dataplane.base import refuse_stale_logprobs
from rldsl.runtime.ray_lowering.trace import prompt_groups
from rldsl.runtime.ray_lowering.weight_group import WeightGroupMember
from rldsl.runtime.ray_lowering.workers import GENERATED_FIELDS, StageWorker, join_dist_group, named_collectives


class TrainerWorker(StageWorker, WeightGroupMember):
    """One data-parallel rank of the split-step trainer."""

    def __init__(self, pipe, stage, rank, dataplane_spec, dist: dict | None = None,
                 checkpoint: dict | None = None):
        from rldsl.runtime.engines.factory import build_trainer

        super().__init__(pipe, stage, rank, dataplane_spec)
        self.checkpoint = checkpoint or {}  # {"run_dir": ..., "every": N, "keep": K}
        # Held while a stream reads the weights (its own concurrency group, beside the step's calls): whatever
        # changes them waits. The controller already orders them so; this keeps the fence if it ever did not.
        # Reentrant: a step's finish holds it and checkpoints.
        self._weights_read = threading.RLock()
        group = join_dist_group(dist) if dist and dist["world_size"] > 1 else None
        self.engine = build_trainer(stage, pipe, seed=pipe.run.seed, process_group=group)
        self._collectives = named_collectives(dist if group is not None else None)
        self.needs = [p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK, p.FIELD_PROMPT_IDS, p.FIELD_PROMPT_MASK,
                      p.FIELD_ADVANTAGE, p.FIELD_VERSION]
        consumed = {f for e in pipe.edges if e.kind == "data" for f in e.fields}
        self.needs += [f for f in (p.FIELD_BEHAVIOUR_LOGPROBS, p.FIELD_REF_LOGPROBS, p.FIELD_LOSS_MASK)
                       if f in consumed]
        if p.FIELD_BEHAVIOUR_LOGPROBS in consumed and any(
                s.kind == "logprob" and receives_weights(s.kind, bool(s.settings.get("frozen"))) for s in pipe.stages):
            self.needs.append(p.version_field(p.FIELD_BEHAVIOUR_LOGPROBS))  # the fence reads it
        # recompute = batch_start: behaviour logprobs are the trainer's own batch-start weights, not the generator's
        self.fence_at_own_version = any(recomputes_at_batch_start(s) for s in pipe.stages)

    def begin_train_step(self, step: int) -> None:
        with self.tracer.span("begin_train_step", step=step, version=self.engine.version), self._collectives():
            self.engine.begin_train_step(step)

    def train_microbatch(self, step: int, keys: Sequence[str]) -> dict:
        with self.tracer.span("train_microbatch", step=step, version=self.engine.version, groups=prompt_groups(keys)), \
                self._collectives():
            fields = self._get(keys, self.needs)
            stale = refuse_stale_logprobs(fields, self.engine.version if self.fence_at_own_version else None)
            result = self.engine.train_microbatch(step, fields)
            if stale:  # the controller drops them; here they were masked out of the loss
                result = {**result, "refused_keys": [keys[i] for i in stale]}
            return result

    def logprob(self, keys: Sequence[str], version: int | None = None) -> None:
        """A frozen reference scored on this rank (``StagePlan.on_trainer``):
        the LoRA policy with its adapters off is the base. Between two of the
        trainer's calls, as this actor takes one at a time."""
        with self.tracer.span("reference logprob", groups=prompt_groups(keys)):
            fields = self._get(keys, GENERATED_FIELDS)
            self._put(keys, {p.FIELD_REF_LOGPROBS: self.engine.reference_logprobs(fields)})

    def optimizer_step(self, step: int) -> dict:
        """A mini-batch's optimizer step inside the open step (a collective)."""
        with self._weights_read, self.tracer.span("optimizer_step", step=step, version=self.engine.version), \
                self._collectives():
            return self.engine.optimizer_step(step)

    def finish_train_step(self, step: int) -> p.StepResult:
        with self._weights_read, self.tracer.span("finish_train_step", step=step, version=self.engine.version), \
                self._collectives():
            result = self.engine.finish_train_step(step)
        every = self.checkpoint.get("every")
        if every and result.version % every == 0 and self.can_checkpoint():
            self.save_checkpoint()
        return result

    def abort_train_step(self, step: int) -> None:
        with self.tracer.span("abort_train_step", step=step):
            self.engine.abort_train_step(step)

    def version(self) -> int:
        return self.engine.version

    def export_buckets(self, bucket_bytes: int) -> list:
        """The weights into the host bucket cache: one object-store entry per
        bucket, put by rank 0 (every rank takes part: gathering shards is a
        collective). Returns rank 0's references; the others return []."""
        return self._export(bucket_bytes, self.engine.version, to_store=True, send=False)["refs"]

    def stream_weights(self, bucket_bytes: int, version: int, to_store: bool) -> dict:
        """A collective push (every rank takes part in the gathers; rank 0
        sends each bucket while the next is gathered). A failed send is
        reported, not raised: the trainer itself is fine, and every rank
        still finishes its gathers. ``to_store``: rank 0 also puts each
        bucket into the object store (the evaluator's copy)."""
        with self._weights_read:
            return self._export(bucket_bytes, version, to_store, send=True)

    def _export(self, bucket_bytes: int, version: int, to_store: bool, send: bool) -> dict:
        """Walk the engine's buckets once: rank 0 puts each into the object
        store (``to_store``; ``ray.put`` copies it before the engine reuses
        its gather buffer) and sends it to the weight group (``send``). A
        push that goes only rank to rank takes the weights where they are
        (on the GPU: no host round trip) from engines that can give them."""
        import ray

        from rldsl.runtime.transport.stream import BucketSender

        sender = BucketSender(self._member_group(), version) if send and self.rank == 0 else None
        refs, failure, stats = [], None, {}
        transport = "collective" if send else "object_store"
        with self.tracer.span("weight export", version=version, transport=transport) as args, self._awake():
            try:
                on_device = not to_store and getattr(self.engine, "streams_from_device", False)
                buckets = self.engine.weight_buckets(bucket_bytes, on_host=False) if on_device \
                    else self.engine.weight_buckets(bucket_bytes)
                for bucket in buckets:
                    if to_store and self.rank == 0:
                        refs.append(ray.put(bucket))
                    if sender is not None:
                        try:
                            sender.send(bucket)
                        except RuntimeError as error:  # a receiver is gone: keep gathering, report it
                            failure, sender = error, None
                    del bucket
            except BaseException:
                if sender is not None:
                    sender.abort()
                if send:
                    self._leave_weight_group()
                raise
            if sender is not None:
                try:
                    stats = sender.finish().as_dict()
                except RuntimeError as error:
                    failure = error
            if failure is not None:
                self._leave_weight_group()
            args.update(stats, buckets=len(refs))
        return {"refs": refs, "stats": stats, "failed": f"{type(failure).__name__}: {failure}" if failure else None}

    @contextlib.contextmanager
    def _awake(self):
        """A trainer offloaded for the generation phase comes back for a
        weight export or a checkpoint, then goes back to sleep."""
        asleep = getattr(self.engine, "asleep", False)
        if asleep:
            self.engine.wake()
        try:
            yield
        finally:
            if asleep:
                self.engine.sleep()

    def sleep(self) -> None:
        """Colocated: offload for the generation phase (engines that can)."""
        if hasattr(self.engine, "sleep"):
            with self._weights_read, self.tracer.span("sleep"):
                self.engine.sleep()

    def wake(self) -> None:
        if hasattr(self.engine, "wake"):
            with self.tracer.span("wake"):
                self.engine.wake()

    def can_checkpoint(self) -> bool:
        return hasattr(self.engine, "save_checkpoint")

    def save_checkpoint(self) -> int:
        """The engine's state as of the last finished step. A collective:
        every trainer rank calls it (in the same order as the step calls)."""
        from rldsl.runtime.ray_lowering.checkpoint import (
            TRAINER_DIR,
            TRAINER_MARKER,
            checkpoint_dir,
            prune_checkpoints,
            write_json_atomically,
        )

        version = self.engine.version
        directory = checkpoint_dir(self.checkpoint["run_dir"], version)
        # An engine whose checkpoint gathers over the group its export gathers over (fsdp) saves after an
        # export, not beside it (a stop's may come while one streams): two threads' collectives on one group
        # would pair up wrongly
        after_export = contextlib.nullcontext() if getattr(self.engine, "checkpoints_beside_exports", True) \
            else self._weights_read
        with after_export, self.tracer.span("checkpoint save", version=version), self._awake():
            self.engine.save_checkpoint(directory / TRAINER_DIR)
        if self.rank == 0:  # the engine returns once every rank's files are written
            write_json_atomically(directory / TRAINER_MARKER, {"version": version, "engine": self.stage.engine.name,
                                                               "ranks": len(self.stage.ranks)})
            prune_checkpoints(self.checkpoint["run_dir"], self.checkpoint.get("keep", 0))
        return version

    def load_checkpoint(self, directory: str) -> int:
        from rldsl.runtime.ray_lowering.checkpoint import TRAINER_DIR

        with self._weights_read, self.tracer.span("checkpoint load"):
            return self.engine.load_checkpoint(Path(directory) / TRAINER_DIR)
