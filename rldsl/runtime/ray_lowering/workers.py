"""Stage workers: one per rank of a stage, an engine plus its data-plane I/O.

These are plain classes; the launcher turns them into Ray actors. A worker
reads its input fields from the data plane by key and writes its output
fields back (one hop); the controller only passes keys and metadata.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Sequence

from rldsl.plan import PipelinePlan, StagePlan, recomputes_at_batch_start, truncates_long_prompts
from rldsl.runtime import protocols as p
from rldsl.runtime.dataplane.base import align_to_responses
from rldsl.runtime.engines.batch_requests import token_version_runs
from rldsl.runtime.environments import (
    episode_fields,
    episode_rewards,
    episode_runner,
    log_episode_failures,
    reads_episode_reward,
)
from rldsl.runtime.ray_lowering.actor_process import setup_worker_process, where
from rldsl.runtime.ray_lowering.trace import Tracer, prompt_groups
from rldsl.runtime.ray_lowering.weight_group import EngineInGroup, WeightGroupMember

log = logging.getLogger(__name__)

GENERATED_FIELDS = [p.FIELD_PROMPT_IDS, p.FIELD_PROMPT_MASK, p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK]
ANSWER_IDS = "answer_ids"  # the reference answer, tokenised, for reward workers
ANSWER_MASK = "answer_mask"  # which of ANSWER_IDS are tokens: id 0 is a real token in many vocabularies


class StageWorker:
    """What every stage worker has: its engine's process set up, a tracer and the data plane."""

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


class GeneratorWorker(StageWorker, WeightGroupMember):
    """One generator replica, a threaded actor: every call of ``generate`` (one
    prompt group) waits in its own thread while the engine's batcher decodes
    all the groups in flight together; weights arrive on another thread and
    are swapped in between two batches.

    ``tenants``: the ``(pipeline, stage)`` of other pipelines' generate
    stages `served_by` this one. Each gets an engine of its own over this
    engine's base weights (the same tensors) with its own adapters, batcher
    and weight versions; their controllers reach it through ``serve``."""

    def __init__(self, pipe, stage, rank, dataplane_spec, tenants=()):
        from rldsl.runtime.engines.factory import build_generator

        super().__init__(pipe, stage, rank, dataplane_spec)
        serves = tuple(lora for served, served_stage in tenants for lora in [served.model(served_stage.model).lora]
                       if lora is not None)
        self._serve(build_generator(stage, pipe, seed=pipe.run.seed + 1000 * rank, serves=serves))
        self.tenants = {served.name: self._tenant(served, served_stage) for served, served_stage in tenants}

    def _tenant(self, pipe, stage) -> "GeneratorWorker":
        """Another pipeline's side of this replica: its engine shares this one's base."""
        from rldsl.runtime.engines.factory import build_generator

        tenant = object.__new__(type(self))
        tenant.pipe, tenant.stage, tenant.rank, tenant.partition = pipe, stage, self.rank, pipe.name
        tenant.tracer, tenant.dataplane, tenant.tenants = self.tracer, self.dataplane, {}
        tenant._serve(build_generator(stage, pipe, seed=pipe.run.seed + 1000 * self.rank, base=self.engine))
        return tenant

    def serve(self, tenant: str, method: str, *args):
        """A call of pipeline ``tenant``'s controller, answered by its side of this replica."""
        return getattr(self.tenants[tenant], method)(*args)

    def _serve(self, engine) -> None:
        from rldsl.runtime.engines.batching import ContinuousBatcher

        pipe, stage = self.pipe, self.stage
        self.engine = engine
        self.batcher = ContinuousBatcher(self.engine, update=stage.settings.get("update", "between_requests"))
        self.episodes = episode_runner(pipe, stage, self.batcher, getattr(self.engine, "tokenizer", None))
        self._tokens_answered = 0  # response tokens of the groups answered (engines that count none as they go)
        tokenizer = getattr(self.engine, "tokenizer", None)  # the sim engine has none: nothing to mask
        self.engine_end_ids = (tokenizer.eos_id, *stage.settings.get("stop_token_ids", ())) if tokenizer else ()
        self._evaluation = None  # ReplicaEvaluation, built on the first `evaluate`
        self.masks_prompts = bool(pipe.datasets) and truncates_long_prompts(pipe.datasets[0].options)

    def generate(self, prompts: list[p.Prompt], keys: Sequence[str], samples_per_prompt: int, seed: int):
        with self.tracer.span("generate", groups=prompt_groups(keys)) as args:
            if self.episodes is not None:  # each sample an episode of the stage's environment
                batch, failures = self.episodes.run(prompts, samples_per_prompt, seed)
                log_episode_failures(failures, self.stage.name, keys)
            else:
                batch = self.batcher.submit(prompts, samples_per_prompt, seed)
                if self.stage.settings.get("truncated") == "mask" and self.engine_end_ids:
                    p.mask_truncated(batch, self.stage.settings["max_new_tokens"], self.engine_end_ids)
            if self.masks_prompts:  # `long_prompts = truncate`: every batch carries the loss mask
                p.mask_truncated_prompts(batch, prompts, samples_per_prompt)
            runs = token_version_runs(batch.pop(p.FIELD_TOKEN_VERSIONS, None), batch[p.FIELD_RESPONSE_MASK])
            version = int(batch[p.FIELD_VERSION][0]) if len(keys) else self.batcher.version
            args["version"] = version
            batch[ANSWER_IDS], batch[ANSWER_MASK] = self._answers(prompts, samples_per_prompt)
            self._put(keys, batch)
        tokens = int(batch[p.FIELD_RESPONSE_MASK].sum())
        self._tokens_answered += tokens
        return p.Generated(version, tokens, runs, p.sample_token_counts(batch))

    def evaluate(self, timeout_s: float = 0.0) -> dict:
        """Held-out evaluation with the weights this replica holds
        (``eval_on = generators``, generator_evaluation.py): no training sample."""
        from rldsl.runtime.ray_lowering.generator_evaluation import ReplicaEvaluation

        if self._evaluation is None:
            self._evaluation = ReplicaEvaluation(self.pipe, self.rank)
        with self.tracer.span("evaluation", timeout_s=timeout_s) as args:
            result = self._evaluation.evaluate(self.batcher, timeout_s)
            args.update(version=result["version"], timed_out=bool(result.get("timed_out")))
        return result

    def decoded_tokens(self) -> int:
        """Tokens decoded so far: counted per decode step by engines that do
        (``tokens_decoded``), else when each group is answered. The watchdog
        counts any change as progress."""
        counted = getattr(self.engine, "tokens_decoded", None)
        return int(counted) if counted is not None else self._tokens_answered

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
        bucket is applied in place as it arrives; decoding resumes after.
        Under ``update = interrupt`` the buckets are staged as they arrive
        and the version lands with the rows in flight (as from the store).
        An engine whose workers stand in the group (vLLM) receives it
        itself, its requests in flight paused meanwhile under ``interrupt``."""
        group = self._member_group()  # a replacement not yet in the group says so at once
        with self.tracer.span("weight receive", version=version, transport="collective") as args:
            try:
                if isinstance(group, EngineInGroup):
                    stats = self.batcher.swap_in_engine(lambda engine: group.receive(engine, version))
                elif self.batcher.interrupts:
                    stats = self._receive_into(self.batcher, version)
                else:
                    stats = self.batcher.run_idle(lambda engine: self._receive_into(engine, version))
            except BaseException:
                self._leave_weight_group()
                raise
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

    def abort(self) -> int:
        """The run has ended: groups still decoding end now (engines that can abort)."""
        return self.batcher.abort()

    def batching(self) -> dict:
        return self.batcher.stats()

    def sleep(self) -> None:
        with self.tracer.span("sleep"):
            self.batcher.sleep()

    def wake(self) -> None:
        with self.tracer.span("wake"):
            self.batcher.wake()


class RewardWorker(StageWorker):
    """Scores responses with the stage's `module:function`, run in the
    worker's reward processes (rldsl.runtime.reward_pool): a reward that
    raises, overruns its timeout, crashes or returns a non-number drops
    that sample only, as a ``RewardFailure`` with the reason."""

    def __init__(self, pipe, stage, rank, dataplane_spec):
        from rldsl.runtime.reward_pool import DEFAULT_PROCESSES, RewardPool

        super().__init__(pipe, stage, rank, dataplane_spec)
        self.reads_episodes = reads_episode_reward(stage.settings["fn"])  # the reward is the episode's: no pool
        self.episode_fields = episode_fields(pipe)
        # the processes start now, in the background, while the rest of the run starts
        self.pool = None if self.reads_episodes else RewardPool(
            stage.settings["fn"], stage.settings.get("processes", DEFAULT_PROCESSES), stage.settings.get("timeout"),
            stage.settings.get("straggler", 0.0))
        self.tokenizer = policy_tokenizer(pipe)

    def ready(self) -> bool:
        """Once the reward processes have imported the function (a function
        that does not import fails here, at start, not on every sample)."""
        if self.pool is not None:
            self.pool.wait_ready()
        return True

    def reward(self, keys: Sequence[str]) -> list[float | p.RewardFailure]:
        with self.tracer.span("reward", groups=prompt_groups(keys)):
            return self._score(keys)

    def _score(self, keys: Sequence[str]) -> list[float | p.RewardFailure]:
        if self.reads_episodes:
            return episode_rewards(self._get(keys, self.episode_fields))
        results = self.pool.score(self._samples(keys))
        self._log_failures(keys, results)
        return results

    def _samples(self, keys: Sequence[str]) -> list[tuple[str, str, str]]:
        """(response, answer, prompt) of each key, as text."""
        fields = self._get(keys, [p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK, p.FIELD_PROMPT_IDS,
                                  p.FIELD_PROMPT_MASK, ANSWER_IDS, ANSWER_MASK])
        return [(self._decode(fields, p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK, row),
                 self._decode(fields, ANSWER_IDS, ANSWER_MASK, row),
                 self._decode(fields, p.FIELD_PROMPT_IDS, p.FIELD_PROMPT_MASK, row)) for row in range(len(keys))]

    def _log_failures(self, keys: Sequence[str], results: list) -> None:
        failures = [(key, r) for key, r in zip(keys, results) if isinstance(r, p.RewardFailure)]
        if failures:
            key, first = failures[0]
            log.warning("reward %s dropped %d of %d samples; %s: %s (%s)", self.stage.name, len(failures),
                        len(keys), key, first.detail, first.reason)

    def _decode(self, fields: dict, ids_field: str, mask_field: str, row: int) -> str:
        """The tokens the mask marks (padding is masked, never guessed from
        the id: 0 is a real token in Llama-3's and Qwen's vocabularies)."""
        if self.tokenizer is None:
            return ""
        ids, mask = fields[ids_field][row], fields[mask_field][row]
        return self.tokenizer.decode([int(i) for i, keep in zip(ids, mask) if int(keep)])


def policy_tokenizer(pipe: PipelinePlan):
    """The policy's tokenizer, loaded without the weights (None for sim)."""
    gens = [s for s in pipe.stages if s.kind == "generate"]
    if not gens or gens[0].engine.name == "sim":
        return None
    from rldsl.models import load_tokenizer

    return load_tokenizer(next(m for m in pipe.models if m.name == gens[0].model).source)


class LogprobWorker(StageWorker):
    """One rank of a logprob stage. The ranks of a model-parallel replica
    (megatron tp x pp > 1) form a process group and all take part in every
    batch; only the last pipeline stage has the result, and its first
    tensor-parallel rank writes and reports it, once per replica. The ranks
    of a sharded fsdp stage's shard group are one replica too: each scores
    a share of the rows, all end with the whole batch, the first writes."""

    def __init__(self, pipe, stage, rank, dataplane_spec, dist: dict | None = None):
        from rldsl.runtime.engines.factory import build_logprob, logprob_copy_ranks

        super().__init__(pipe, stage, rank, dataplane_spec)
        copy_ranks = logprob_copy_ranks(stage)
        group = None
        if dist and dist["world_size"] > 1 and (stage.engine.name == "megatron" or copy_ranks > 1):
            group = join_dist_group(dist)  # megatron builds its tp / dp groups from the default group
        self.engine = build_logprob(stage, pipe, seed=pipe.run.seed + 2000 + rank,
                                    process_group=group if copy_ranks > 1 else None)
        self.frozen = bool(stage.settings.get("frozen"))
        self.field = p.logprob_field(self.frozen)
        placed = stage.ranks[rank]
        self.writes = placed.tp_rank == 0 and placed.pp_rank == stage.pp - 1 and rank % copy_ranks == 0
        self.version = 0  # the newest weights pushed to it
        # batch_start: only the trainer's newest version is ever asked for
        window = 0 if recomputes_at_batch_start(stage) else pipe.staleness.max_lag
        self.scorer = None if self.frozen else _versioned_scorer(self.engine, window)

    def logprob(self, keys: Sequence[str], version: int | None = None) -> list[int] | None:
        """Scores and writes; a policy stage scores each row with the version
        that generated it (logprob_versions.py), or with ``version`` when
        given (``recompute = batch_start``), and its writing rank reports the
        version used, per key (the other ranks report None)."""
        import torch

        with self.tracer.span("logprob", groups=prompt_groups(keys)) as args:
            if self.scorer is None:
                logprobs, used = self.engine.logprobs(self._get(keys, GENERATED_FIELDS)), None
            else:
                fields = self._get(keys, GENERATED_FIELDS + [p.FIELD_VERSION])
                generated_at = fields.pop(p.FIELD_VERSION).reshape(-1).tolist()
                logprobs, used = self.scorer.score_at(fields, generated_at, version)
                args["version"] = sorted(set(used))
            if self.writes:
                fields = {self.field: logprobs}
                if used is not None:
                    fields[p.version_field(self.field)] = torch.tensor(used, dtype=torch.long)
                self._put(keys, fields)
        return None if used is None or not self.writes else used

    def receive_weights(self, bucket_refs: list, version: int) -> None:
        """A push: kept until a row generated with it is scored (a frozen
        reference receives none)."""
        import ray

        with self.tracer.span("weight receive", version=version, buckets=len(bucket_refs)):
            if self.scorer is not None:
                self.scorer.receive(bucket_refs, version)
            else:
                buckets = ray.get(bucket_refs)
                for index, bucket in enumerate(buckets):
                    self.engine.update_weights(bucket, version, index == len(buckets) - 1)
            self.version = version


def _versioned_scorer(engine, max_lag: int):
    import ray

    from rldsl.runtime.ray_lowering.logprob_versions import VersionedScorer

    return VersionedScorer(engine, max_lag, ray.get)


def named_collectives(dist: dict | None):
    """A context for the trainer's calls: collective timeouts name the group."""
    if dist is None:
        return contextlib.nullcontext
    from rldsl.runtime.ray_lowering.rendezvous import collectives_named

    return lambda: collectives_named(dist["group"], dist["rank"], dist["world_size"])


def join_dist_group(dist: dict):
    """This rank's process group of its stage (data or model parallel ranks)."""
    from rldsl.runtime.ray_lowering.rendezvous import join_process_group

    return join_process_group(dist["group"], dist["rank"], dist["world_size"], dist.get("store_dir"))
