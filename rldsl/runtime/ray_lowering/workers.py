"""Stage workers: one per rank of a stage, an engine plus its data-plane I/O.

These are plain classes; the launcher turns them into Ray actors. A worker
reads its input fields from the data plane by key and writes its output
fields back (one hop); the controller only passes keys and metadata.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Sequence

from rldsl.plan import PipelinePlan, StagePlan, receives_weights
from rldsl.runtime import protocols as p
from rldsl.runtime.dataplane.base import align_to_responses, refuse_stale_logprobs
from rldsl.runtime.ray_lowering.actor_process import setup_worker_process, where
from rldsl.runtime.ray_lowering.trace import Tracer, prompt_groups
from rldsl.runtime.ray_lowering.weight_group import WeightGroupMember

log = logging.getLogger(__name__)

GENERATED_FIELDS = [p.FIELD_PROMPT_IDS, p.FIELD_PROMPT_MASK, p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK]
ANSWER_IDS = "answer_ids"  # the reference answer, tokenised, for reward workers
ANSWER_MASK = "answer_mask"  # which of ANSWER_IDS are tokens: id 0 is a real token in many vocabularies


class _Worker:
    def __init__(self, pipe: PipelinePlan, stage: StagePlan, rank: int, dataplane_spec: dict):
        from rldsl.runtime.dataplane import connect_dataplane

        setup_worker_process()
        self.pipe, self.stage, self.rank = pipe, stage, rank
        self.partition = pipe.name
        where_planned = stage.ranks[rank]
        self.tracer = Tracer(f"{stage.name}-{rank}", stage.name, stage.kind, rank, where_planned.gpus,
                             where_planned.node)
        self.dataplane = connect_dataplane(dataplane_spec)

    def ready(self) -> bool:
        return True

    def placement(self) -> dict:
        """This actor's Ray node and devices, checked against the plan."""
        return where()

    def trace(self) -> dict:
        """The spans recorded since the last call (the driver drains them)."""
        return self.tracer.drain()

    def _get(self, keys: Sequence[str], fields: list[str]) -> dict:
        with self.tracer.span("dataplane get", rows=len(keys)):
            return align_to_responses(self.dataplane.get(list(keys), self.partition, fields))

    def _put(self, keys: Sequence[str], fields: dict) -> None:
        with self.tracer.span("dataplane put", rows=len(keys)):
            self.dataplane.put(list(keys), self.partition, fields)


class GeneratorWorker(_Worker, WeightGroupMember):
    """One generator replica, a threaded actor: every call of ``generate`` (one
    prompt group) waits in its own thread while the engine's batcher decodes
    all the groups in flight together; weights arrive on another thread and
    are swapped in between two batches."""

    def __init__(self, pipe, stage, rank, dataplane_spec):
        from rldsl.runtime.engines.batching import ContinuousBatcher
        from rldsl.runtime.engines.factory import build_generator

        super().__init__(pipe, stage, rank, dataplane_spec)
        self.engine = build_generator(stage, pipe, seed=pipe.run.seed + 1000 * rank)
        self.batcher = ContinuousBatcher(self.engine)

    def generate(self, prompts: list[p.Prompt], keys: Sequence[str], samples_per_prompt: int, seed: int):
        with self.tracer.span("generate", groups=prompt_groups(keys)) as args:
            batch = self.batcher.submit(prompts, samples_per_prompt, seed)
            version = int(batch[p.FIELD_VERSION][0]) if len(keys) else self.batcher.version
            args["version"] = version
            batch[ANSWER_IDS], batch[ANSWER_MASK] = self._answers(prompts, samples_per_prompt)
            self._put(keys, batch)
        return p.Generated(version, int(batch[p.FIELD_RESPONSE_MASK].sum()))

    def _answers(self, prompts, samples_per_prompt):
        """The answers' token ids, right-padded, and the mask of real tokens."""
        import torch

        tokenizer = getattr(self.engine, "tokenizer", None)
        rows = [tokenizer.encode(pr.answer) if tokenizer else [] for pr in prompts for _ in range(samples_per_prompt)]
        width = max(1, max(len(r) for r in rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        return ids, mask

    def receive_weights(self, bucket_refs: list, version: int) -> None:
        """A push: stage every bucket while generation goes on."""
        import ray

        with self.tracer.span("weight receive", version=version, buckets=len(bucket_refs)):
            buckets = ray.get(bucket_refs)
            for index, bucket in enumerate(buckets):
                self.batcher.update_weights(bucket, version, index == len(buckets) - 1)

    def receive_stream(self, version: int) -> dict:
        """A collective push: once the rows in flight have ended, every
        bucket is applied in place as it arrives; decoding resumes after."""
        self._member_group()  # a replacement not yet in the group says so at once
        with self.tracer.span("weight receive", version=version, transport="collective") as args:
            stats = self.batcher.run_idle(lambda engine: self._receive_into(engine, version))
            args.update(stats)
        return stats

    def refresh(self, bucket_refs: list, version: int) -> None:
        """A replica that slept through pushes: load ``version`` from the host cache."""
        import ray

        if self.batcher.version >= version:
            return
        with self.tracer.span("weight refresh", version=version, buckets=len(bucket_refs)):
            self.batcher.refresh(ray.get(bucket_refs), version)

    def version(self) -> int:
        return self.batcher.version

    def batching(self) -> dict:
        return self.batcher.stats()

    def sleep(self) -> None:
        with self.tracer.span("sleep"):
            self.batcher.sleep()

    def wake(self) -> None:
        with self.tracer.span("wake"):
            self.batcher.wake()


class RewardWorker(_Worker):
    """Scores responses with the stage's `module:function`, run in the
    worker's reward processes (rldsl.runtime.reward_pool): a reward that
    raises, overruns its timeout, crashes or returns a non-number drops
    that sample only, as a ``RewardFailure`` with the reason."""

    def __init__(self, pipe, stage, rank, dataplane_spec):
        from rldsl.runtime.reward_pool import DEFAULT_PROCESSES, RewardPool

        super().__init__(pipe, stage, rank, dataplane_spec)
        # the processes start now, in the background, while the rest of the run starts
        self.pool = RewardPool(stage.settings["fn"], stage.settings.get("processes", DEFAULT_PROCESSES),
                               stage.settings.get("timeout"))
        self.tokenizer = _tokenizer_for(pipe)

    def ready(self) -> bool:
        """Once the reward processes have imported the function (a function
        that does not import fails here, at start, not on every sample)."""
        self.pool.wait_ready()
        return True

    def reward(self, keys: Sequence[str]) -> list[float | p.RewardFailure]:
        with self.tracer.span("reward", groups=prompt_groups(keys)):
            return self._score(keys)

    def _score(self, keys: Sequence[str]) -> list[float | p.RewardFailure]:
        fields = self._get(keys, [p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK, p.FIELD_PROMPT_IDS,
                                  p.FIELD_PROMPT_MASK, ANSWER_IDS, ANSWER_MASK])
        samples = [(self._decode(fields, p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK, row),
                    self._decode(fields, ANSWER_IDS, ANSWER_MASK, row),
                    self._decode(fields, p.FIELD_PROMPT_IDS, p.FIELD_PROMPT_MASK, row)) for row in range(len(keys))]
        results = self.pool.score(samples)
        failures = [(key, r) for key, r in zip(keys, results) if isinstance(r, p.RewardFailure)]
        if failures:
            key, first = failures[0]
            log.warning("reward %s dropped %d of %d samples; %s: %s (%s)", self.stage.name, len(failures),
                        len(keys), key, first.detail, first.reason)
        return results

    def _decode(self, fields: dict, ids_field: str, mask_field: str, row: int) -> str:
        """The tokens the mask marks (padding is masked, never guessed from
        the id: 0 is a real token in Llama-3's and Qwen's vocabularies)."""
        if self.tokenizer is None:
            return ""
        ids, mask = fields[ids_field][row], fields[mask_field][row]
        return self.tokenizer.decode([int(i) for i, keep in zip(ids, mask) if int(keep)])


def _tokenizer_for(pipe: PipelinePlan):
    """The policy's tokenizer, loaded without the weights (None for sim)."""
    gens = [s for s in pipe.stages if s.kind == "generate"]
    if not gens or gens[0].engine.name == "sim":
        return None
    from rldsl.models import load_tokenizer

    return load_tokenizer(next(m for m in pipe.models if m.name == gens[0].model).source)


class LogprobWorker(_Worker):
    """One rank of a logprob stage. The ranks of a model-parallel replica
    (megatron tp x pp > 1) form a process group and all take part in every
    batch; only the last pipeline stage has the result, and its first
    tensor-parallel rank writes and reports it, once per replica."""

    def __init__(self, pipe, stage, rank, dataplane_spec, dist: dict | None = None):
        from rldsl.runtime.engines.factory import build_logprob

        super().__init__(pipe, stage, rank, dataplane_spec)
        if dist and dist["world_size"] > 1 and stage.engine.name == "megatron":
            _join(dist)  # megatron builds its tp / dp groups from the default group
        self.engine = build_logprob(stage, pipe, seed=pipe.run.seed + 2000 + rank)
        self.frozen = bool(stage.settings.get("frozen"))
        self.field = p.logprob_field(self.frozen)
        placed = stage.ranks[rank]
        self.writes = placed.tp_rank == 0 and placed.pp_rank == stage.pp - 1
        self.version = 0  # the weights it scores with; the trainer's fence compares it to each row's

    def logprob(self, keys: Sequence[str]) -> list[int] | None:
        """Scores and writes; the writing rank of a policy stage reports the
        version it scored with, per key (the other ranks report None)."""
        import torch

        with self.tracer.span("logprob", groups=prompt_groups(keys), version=self.version):
            logprobs = self.engine.logprobs(self._get(keys, GENERATED_FIELDS))
            if self.writes:
                fields = {self.field: logprobs}
                if not self.frozen:
                    fields[p.version_field(self.field)] = torch.full((len(keys),), self.version, dtype=torch.long)
                self._put(keys, fields)
        return None if self.frozen or not self.writes else [self.version] * len(keys)

    def receive_weights(self, bucket_refs: list, version: int) -> None:
        """A push: applied in place between two logprob calls (the actor runs one call at a time)."""
        import ray

        with self.tracer.span("weight receive", version=version, buckets=len(bucket_refs)):
            buckets = ray.get(bucket_refs)
            for index, bucket in enumerate(buckets):
                self.engine.update_weights(bucket, version, index == len(buckets) - 1)
            self.version = version


class TrainerWorker(_Worker, WeightGroupMember):
    """One data-parallel rank of the split-step trainer."""

    def __init__(self, pipe, stage, rank, dataplane_spec, dist: dict | None = None,
                 checkpoint: dict | None = None):
        from rldsl.runtime.engines.factory import build_trainer

        super().__init__(pipe, stage, rank, dataplane_spec)
        self.checkpoint = checkpoint or {}  # {"run_dir": ..., "every": N}
        group = _join(dist) if dist and dist["world_size"] > 1 else None
        self.engine = build_trainer(stage, pipe, seed=pipe.run.seed, process_group=group)
        self._collectives = _named_collectives(dist if group is not None else None)
        self.needs = [p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK, p.FIELD_PROMPT_IDS, p.FIELD_PROMPT_MASK,
                      p.FIELD_ADVANTAGE, p.FIELD_VERSION]
        consumed = {f for e in pipe.edges if e.kind == "data" for f in e.fields}
        self.needs += [f for f in (p.FIELD_BEHAVIOUR_LOGPROBS, p.FIELD_REF_LOGPROBS) if f in consumed]
        if p.FIELD_BEHAVIOUR_LOGPROBS in consumed and any(
                s.kind == "logprob" and receives_weights(s.kind, bool(s.settings.get("frozen"))) for s in pipe.stages):
            self.needs.append(p.version_field(p.FIELD_BEHAVIOUR_LOGPROBS))  # the fence reads it

    def begin_train_step(self, step: int) -> None:
        with self.tracer.span("begin_train_step", step=step, version=self.engine.version), self._collectives():
            self.engine.begin_train_step(step)

    def train_microbatch(self, step: int, keys: Sequence[str]) -> dict:
        with self.tracer.span("train_microbatch", step=step, version=self.engine.version, groups=prompt_groups(keys)), \
                self._collectives():
            fields = self._get(keys, self.needs)
            stale = refuse_stale_logprobs(fields)
            result = self.engine.train_microbatch(step, fields)
            if stale:  # the controller drops them; here they were masked out of the loss
                result = {**result, "refused_keys": [keys[i] for i in stale]}
            return result

    def optimizer_step(self, step: int) -> dict:
        """A mini-batch's optimizer step inside the open step (a collective)."""
        with self.tracer.span("optimizer_step", step=step, version=self.engine.version), self._collectives():
            return self.engine.optimizer_step(step)

    def finish_train_step(self, step: int) -> p.StepResult:
        with self.tracer.span("finish_train_step", step=step, version=self.engine.version), self._collectives():
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
        import ray

        with self.tracer.span("weight export", version=self.engine.version) as args, self._awake():
            buckets = [{k: v.detach().cpu().clone() for k, v in b.items()}
                       for b in self.engine.weight_buckets(bucket_bytes)]
            args["buckets"] = len(buckets)
        return [ray.put(bucket) for bucket in buckets] if self.rank == 0 else []

    def stream_weights(self, bucket_bytes: int, version: int, to_store: bool) -> dict:
        """A collective push (every rank takes part in the gathers; rank 0
        sends each bucket while the next is gathered). A failed send is
        reported, not raised: the trainer itself is fine, and every rank
        still finishes its gathers. ``to_store``: rank 0 also puts each
        bucket into the object store (the evaluator's copy)."""
        import ray

        from rldsl.runtime.transport.stream import BucketSender

        sender = BucketSender(self._member_group(), version) if self.rank == 0 else None
        refs, failure, stats = [], None, {}
        with self.tracer.span("weight export", version=version, transport="collective") as args, self._awake():
            try:
                for bucket in self.engine.weight_buckets(bucket_bytes):
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
                raise
            if sender is not None:
                try:
                    stats = sender.finish().as_dict()
                except RuntimeError as error:
                    failure = error
            args.update(stats)
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
            with self.tracer.span("sleep"):
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
            write_json_atomically,
        )

        version = self.engine.version
        directory = checkpoint_dir(self.checkpoint["run_dir"], version)
        with self.tracer.span("checkpoint save", version=version), self._awake():
            self.engine.save_checkpoint(directory / TRAINER_DIR)
        if self.rank == 0:  # the engine returns once every rank's files are written
            write_json_atomically(directory / TRAINER_MARKER, {"version": version, "engine": self.stage.engine.name,
                                                               "ranks": len(self.stage.ranks)})
        return version

    def load_checkpoint(self, directory: str) -> int:
        from rldsl.runtime.ray_lowering.checkpoint import TRAINER_DIR

        with self.tracer.span("checkpoint load"):
            return self.engine.load_checkpoint(Path(directory) / TRAINER_DIR)


def _named_collectives(dist: dict | None):
    """A context for the trainer's calls: collective timeouts name the group."""
    if dist is None:
        return contextlib.nullcontext
    from rldsl.runtime.ray_lowering.rendezvous import collectives_named

    return lambda: collectives_named(dist["group"], dist["rank"], dist["world_size"])


def _join(dist: dict):
    from rldsl.runtime.ray_lowering.rendezvous import join_process_group

    return join_process_group(dist["group"], dist["rank"], dist["world_size"], dist.get("store_dir"))
