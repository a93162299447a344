"""The single controller as a CPU-only Ray actor.

It owns the control plane's pumps (rldsl.runtime.control), answers progress
queries from the driver while they run (an async actor serves both), writes
the controller's half of each checkpoint (checkpoint.py), and appends the
run's journal to RUN_DIR/journal.jsonl (the controller flushes it after every
step and however the run ends).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rldsl.plan import PipelinePlan
from rldsl.runtime.control.journal import JOURNAL_FILE, Journal, JournalFile
from rldsl.runtime.control.prompts import prompt_stream
from rldsl.runtime.control.settings import RunSettings


class ControllerActor:
    def __init__(self, settings: RunSettings, pipe: PipelinePlan, workers: dict, specs: dict, dataplane_spec: dict,
                 checkpoint: dict | None = None, resume: dict | None = None, observers: list | None = None,
                 scheduler=None, transport: dict | None = None):
        from rldsl.runtime.dataplane import connect_dataplane
        from rldsl.runtime.engines.factory import trainer_exports_beside_steps
        from rldsl.runtime.ray_lowering.checkpoint import expand_indices
        from rldsl.runtime.ray_lowering.stage_handles import HostBucketCache, ray_stage_handles, reward_calls_per_worker
        from rldsl.runtime.ray_lowering.supervision import Supervisor
        from rldsl.runtime.ray_lowering.trace import Tracer

        self.settings, self.pipe = settings, pipe
        # two tracks: the train pump's data-plane calls, and the sync pump's pushes (they overlap in time)
        self.tracers = [Tracer("controller", "controller", "controller", 0), Tracer("weight push", "controller",
                                                                                    "controller", 1)]
        kinds = {s.name: s.kind for s in pipe.stages}
        train = pipe.stage(pipe.batch.train_stage)
        replicas = {s.name: _replicas(s) for s in pipe.stages if s.kind in ("train", "logprob")}
        receiver_stages = pipe.weight_receivers()
        self.supervisor = Supervisor(specs, workers)  # replaces dead generator, reward and logprob actors
        self.observers = list(observers or [])  # the evaluator; replaced in place (adopt_observer)
        self.cache = HostBucketCache()
        self.transport = transport or {"transport": "object_store", "why": "not chosen"}
        self.collective = _collective_sync(pipe, self.transport)
        self.handles = ray_stage_handles(self.supervisor, kinds, receiver_stages, settings.sync_bucket_bytes,
                                         train.name, replicas, self.observers, tracer=self.tracers[1],
                                         cache=self.cache, collective=self.collective,
                                         export_overlaps=trainer_exports_beside_steps(train),
                                         reward_calls={s.name: reward_calls_per_worker(s) for s in pipe.stages
                                                       if s.kind == "reward"})
        self.dataplane = _TracedDataPlane(connect_dataplane(dataplane_spec), self.tracers[0])
        self.dataplane_actors = self.dataplane.service_actors()  # watched while the run goes (dataplane_watch.py)
        self.leases = None
        if scheduler is not None:  # the pipeline shares GPUs: its turns come from the cluster's lease scheduler
            from rldsl.runtime.ray_lowering.gpu_scheduler import RayLeases

            self.leases = RayLeases(scheduler, pipe.name)
        self.checkpoint = checkpoint or {}
        resume = resume or {}
        self.step_offset = resume.get("steps_done", 0)
        run_dir = self.checkpoint.get("run_dir")
        self.journal_file = JournalFile(Path(run_dir) / JOURNAL_FILE) if run_dir else None
        self.journal = Journal(self.journal_file,
                               {"steps_done": self.step_offset, "version": resume["version"]} if resume else None)
        below, above = expand_indices(resume.get("trained_prompts", {"below": 0, "above": []}))
        self.trained_before = (below, frozenset(above))
        self.trained = TrainedPrompts(below, above)
        self._ledger_cursor = 0
        self.steps: list[dict] = []
        self.last_version = -1
        self.controller = None
        self.stop_requested = False

    def ready(self) -> bool:
        return True

    async def settle_transport(self) -> dict:
        """How weights will travel, decided now that the trainer runs (an
        open `auto` asks it whether it sees CUDA)."""
        from rldsl.runtime.ray_lowering.weight_group import COLLECTIVE, settle

        if self.collective is not None:
            sees_cuda = await self.supervisor.call(self.pipe.batch.train_stage, 0, "sees_cuda")
            self.transport = settle(self.transport, sees_cuda)
            self.collective.enabled = self.transport["transport"] == COLLECTIVE  # the handles hold it too
        return self.transport

    def adopt_observer(self, actor) -> int | None:
        """A replacement evaluator: it gets every later push, and the newest
        exported weights now. Returns that version (None before the first export)."""
        self.observers[:] = [actor]
        refs = list(self.cache.refs)
        for index, ref in enumerate(refs):
            actor.update_weights.remote(ref, self.cache.version, index == len(refs) - 1)
        return self.cache.version

    async def run(self) -> dict:
        from rldsl.runtime.control.controller import Controller

        prompts = prompt_stream(self.pipe, self.settings.seed, *self.trained_before)
        self.controller = Controller(self.settings, self.handles, self.dataplane, prompts, on_step=self._on_step,
                                     journal=self.journal, leases=self.leases)
        if self.stop_requested:
            self.controller.request_stop()
        from rldsl.runtime.ray_lowering.dataplane_watch import run_watched

        await run_watched(self.controller.run(), self.dataplane_actors)  # DataPlaneLost when one of them dies
        return self.summary()

    def summary(self) -> dict | None:
        """The run's summary so far, with how it ended (also after a failure:
        the driver writes summary.json on every exit path); None before it started."""
        if self.controller is None:
            return None
        summary = self.controller.summary()
        summary["steps"] += self.step_offset
        summary["recoveries"] = [vars(r) for r in self.supervisor.recoveries]
        if self.supervisor.losses:
            summary["lost_workers"] = list(self.supervisor.losses)
        summary["weight_transport"] = self._transport_figures()
        if self.journal_file is not None and self.journal_file.repairs:  # a torn line mended before appending
            summary["journal_repairs"] = list(self.journal_file.repairs)
        return summary

    def _transport_figures(self) -> dict:
        """How weights travelled: the transport, why, and for a collective
        one its failed pushes (each fell back to the object store) and the
        last push's buckets, bytes, seconds and the most payload held."""
        figures = {"transport": self.transport["transport"], "why": self.transport["why"]}
        if self.collective is not None and self.collective.enabled:
            figures.update(failed_pushes=self.collective.failures, lost_receivers=len(self.collective.lost),
                           last_push=self.collective.last_stats)
        return figures

    def request_stop(self) -> None:
        """Ctrl-C: finish the trainer call in flight, abort an open step, return."""
        self.stop_requested = True
        if self.controller is not None:
            self.controller.request_stop()

    def _on_step(self, record: dict) -> None:
        record = {**record, "step": record["step"] + self.step_offset, "time": time.time()}
        self.steps.append(record)
        self.last_version = record["version"]
        every = self.checkpoint.get("every")
        if every and record["version"] % every == 0:
            self._write_progress(record["version"], record["step"])

    def _trained_prompts(self) -> dict:
        """Every prompt trained so far, this run and before; reads only the
        keys trained since the last call."""
        from rldsl.runtime.dataplane import parse_sample_key

        new_keys = self.controller.state.ledger.trained_keys(self._ledger_cursor)
        self._ledger_cursor += len(new_keys)
        self.trained.add(parse_sample_key(key)[1] for key in new_keys)
        return self.trained.compressed()

    def _write_progress(self, version: int, step: int) -> None:
        from rldsl.runtime.ray_lowering.checkpoint import PROGRESS_FILE, checkpoint_dir, prune_checkpoints
        from rldsl.runtime.run_files import write_json_checked  # a full disk: RunDirectoryError, named

        run_dir = Path(self.checkpoint["run_dir"])
        write_json_checked(checkpoint_dir(run_dir, version) / PROGRESS_FILE,
                           {"version": version, "steps_done": step, "trained_prompts": self._trained_prompts()})
        prune_checkpoints(run_dir, self.checkpoint.get("keep", 0))

    async def save_progress(self, version: int, timeout_s: float = 30.0) -> bool:
        """The controller's half of an on-demand checkpoint at ``version``:
        waits until that step's samples are recorded as trained."""
        deadline = time.monotonic() + timeout_s
        while self.last_version < version and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.last_version != version or self.controller is None:
            return False
        self._write_progress(version, self.steps[-1]["step"])
        return True

    async def progress(self, since: int) -> dict:
        """Step records after ``since``, what each pump is waiting on and the
        calls in flight per stage, now."""
        recoveries = self._recoveries()
        if self.controller is None:
            return {"steps": [], "waits": "starting", "pumps": {}, "active": {}, **recoveries}
        return {"steps": self.steps[since:], "waits": self.controller.describe_waits(),
                "pumps": self.controller.pump_waits(), "active": self.controller.state.active_calls(), **recoveries}

    def _recoveries(self) -> dict:
        """Every replaced actor so far (the driver shows the new ones) and the
        new handles, so the driver drains the replacements' traces."""
        return {"recoveries": [vars(r) for r in self.supervisor.recoveries],
                "losses": list(self.supervisor.losses),
                "replaced": dict(self.supervisor.replaced_handles)}

    def trace(self) -> list[dict]:
        return [tracer.drain() for tracer in self.tracers]


class TrainedPrompts:
    """Prompt indices as a prefix ``below`` plus the indices ``above`` it:
    adding costs O(new), and the prefix absorbs the set as it fills in."""

    def __init__(self, below: int = 0, above=()) -> None:
        self.below = below
        self.above = set(above)
        self._advance()

    def add(self, indices) -> None:
        self.above.update(i for i in indices if i >= self.below)
        self._advance()

    def compressed(self) -> dict:
        return {"below": self.below, "above": sorted(self.above)}

    def _advance(self) -> None:
        while self.below in self.above:
            self.above.discard(self.below)
            self.below += 1


def _collective_sync(pipe: PipelinePlan, transport: dict):
    """The pipeline's weight group, when its sync goes rank to rank."""
    from rldsl.runtime.ray_lowering.weight_group import OBJECT_STORE, CollectiveSync

    if transport["transport"] == OBJECT_STORE:
        return None
    members = [(s.name, rank.index) for s in pipe.stages if s.kind == "generate" and s.name in pipe.weight_receivers()
               for rank in s.ranks]
    import uuid

    # a restarted run's controller meets in the same store directory: its groups get names of their own
    return CollectiveSync(f"{transport['group']}-{uuid.uuid4().hex[:8]}", members, transport.get("store_dir"))


def _replicas(stage) -> list[list[int]]:
    """Rank indices per data-parallel replica: the ranks that see the same
    rows (a sharded fsdp logprob stage: each shard group)."""
    from rldsl.runtime.engines.factory import logprob_copy_ranks

    copy_ranks = logprob_copy_ranks(stage)
    groups: dict[int, list[int]] = {}
    for rank in stage.ranks:
        groups.setdefault(rank.index // copy_ranks if copy_ranks > 1 else rank.dp_rank, []).append(rank.index)
    return list(groups.values())


class _TracedDataPlane:
    """The controller's data-plane calls, each a span on its trace."""

    def __init__(self, plane, tracer) -> None:
        self.plane, self.tracer = plane, tracer

    def put(self, keys, partition, fields, tags=None):
        with self.tracer.span("dataplane put", rows=len(keys)):
            return self.plane.put(keys, partition, fields, tags)

    def clear(self, keys, partition):
        with self.tracer.span("dataplane clear", rows=len(keys)):
            return self.plane.clear(keys, partition)

    def __getattr__(self, name):
        return getattr(self.plane, name)
