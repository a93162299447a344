"""The single controller: three asyncio pumps that move only metadata.

- rollout pump (rollout_pump.py): prompts -> generate -> reward -> logprob,
  one prompt group per call, several in flight on every generator replica,
  gated by buffer capacity, the in-flight limit and the staleness quota;
- train pump (train_pump.py): the split-step trainer fed ready groups as they
  arrive, every data-parallel replica busy (lanes.py);
- sync pump (sync_pump.py): pushes each exported version to the generator
  replicas without stopping them;
- lease pump (lease_pump.py), when the pipeline shares GPUs with others:
  wakes and puts to sleep the replicas on those GPUs as the cluster's lease
  scheduler (leases.py) grants and asks back their GPUs.

A watchdog (watchdog.py) turns any stall into a ``PipelineStalled`` error
that says what each pump is waiting on; generators decoding tokens count as
progress. Every sample's course goes into the run's journal
(journal.py), flushed after each step and however the run ends. Engines sit
behind ``StageHandles`` (handles.py); the Ray lowering provides them over
actors, ``inprocess.sim_stages`` in process.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Iterable

from rldsl.runtime.control import ledger as outcomes
from rldsl.runtime.control.errors import PipelineStalled, StepFailed, StopRequested, TrainCallFailed
from rldsl.runtime.control.handles import StageHandles
from rldsl.runtime.control.journal import FAILED, FINISHED, INTERRUPTED, STOPPED, Journal, describe_error
from rldsl.runtime.control.lease_pump import LeasePump
from rldsl.runtime.control.leases import LeaseClient
from rldsl.runtime.control.rollout_pump import RolloutPump
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.control.state import RunState, resolve
from rldsl.runtime.control.sync_pump import SyncPump
from rldsl.runtime.control.train_pump import StepCallback, TrainPump
from rldsl.runtime.control.watchdog import Watchdog
from rldsl.runtime.protocols import Prompt

__all__ = ["Controller", "PipelineStalled", "StageHandles", "StepFailed", "StopRequested", "TrainCallFailed"]


class Controller:
    """Runs ``settings.steps`` training steps and returns a summary.

    ``on_step`` receives one dict per finished step (see ``TrainPump._report``);
    ``journal`` records every sample's course (by default kept in memory);
    ``clock`` is injectable for tests. The data plane needs ``put`` and
    ``clear``; its methods may be plain or async."""

    def __init__(
        self,
        settings: RunSettings,
        stages: StageHandles,
        dataplane: Any,
        prompts: Iterable[Prompt],
        *,
        on_step: StepCallback | None = None,
        journal: Journal | None = None,
        clock: Callable[[], float] = time.monotonic,
        leases: LeaseClient | None = None,
    ) -> None:
        self.settings = settings
        self.journal = journal if journal is not None else Journal()
        if settings.leased and leases is None:
            raise ValueError(f"pipeline `{settings.pipeline}` shares GPUs with other pipelines: it needs the "
                             "GPU lease scheduler's client")
        self.state = RunState(settings, stages, dataplane, clock, self.journal, leases)
        self.rollout = RolloutPump(self.state, prompts)
        self.train = TrainPump(self.state, self._step_done(on_step))
        self.sync = SyncPump(self.state)
        self.lease = LeasePump(self.state, self.rollout.wants_capacity) if settings.leased else None
        self.watchdog = Watchdog(self.state, self.describe_waits, stages.decoded_tokens)
        self.exit: str | None = None  # how the run ended (journal.FINISHED, ...), once it has
        self.error: str | None = None

    async def run(self) -> dict:
        """Run to the end and return the summary; the journal records how it
        ended, whatever the way, and is flushed."""
        self.journal.run_started(self.settings.pipeline, self.settings.max_lag, self.settings.steps,
                                 self.settings.ahead_groups)
        try:
            await self._run()
            self._ended(STOPPED if self.state.stop_requested else FINISHED)
        except Exception as error:
            self._ended(FAILED, error)
            raise
        except BaseException as error:  # cancelled: the loop or the process is going away
            self._ended(INTERRUPTED, error)
            raise
        finally:
            self.journal.flush()
        return self.summary()

    async def _run(self) -> None:
        state = self.state
        state.trainer_version = int(await resolve(state.stages.generator_version()))
        state.start_replicas(state.stages.generator_replicas, state.trainer_version)
        state.started_at = state.last_progress = state.clock()
        try:
            if self.lease is not None:
                await self.lease.start()
            await self._supervise()
        finally:
            if self.lease is not None:  # finished or failed: every lease goes back, the others go on
                await asyncio.shield(self.lease.shrink_to_zero())
        await self._settle_leftovers()
        state.ledger.check()

    def _ended(self, exit: str, error: BaseException | None = None) -> None:
        self.exit = exit
        self.error = describe_error(error) if error is not None else None
        self.journal.ended(exit, self.error)

    def _step_done(self, on_step: StepCallback | None) -> StepCallback:
        """The journal is flushed after every step, before the step is reported."""
        def step_done(record: dict) -> None:
            self.journal.flush()
            if self.lease is not None:
                record["replicas_awake"] = f"{self.lease.awake_replicas()}/{len(self.lease.replicas)}"
                record["lease_wait_s"] = round(self.state.lease_wait_s, 3)
            if on_step is not None:
                on_step(record)

        return step_done

    def request_stop(self) -> None:
        """End the run at the next safe point: a trainer call in flight
        completes (a finished step is recorded), an open step is aborted, and
        ``run`` returns its summary with the ledger balanced."""
        self.state.stop_requested = True
        self.state.changed.notify()

    def pump_waits(self) -> dict[str, str]:
        """What each pump is doing or waiting on, now (the watchdog's words)."""
        waits = {"rollout": self.rollout.describe(), "train": self.train.describe(), "sync": self.sync.phase}
        if self.lease is not None:
            waits["leases"] = self.lease.phase
        return waits

    def describe_waits(self) -> str:
        return " ; ".join(f"{pump} pump: {text}" for pump, text in self.pump_waits().items())

    def summary(self) -> dict:
        state = self.state
        elapsed = max(state.clock() - state.started_at, 1e-9)
        return {
            "pipeline": self.settings.pipeline,
            "steps": state.finished_steps,
            "requested_steps": self.settings.steps,
            "version": state.trainer_version,
            "aborted_steps": self.train.aborted_steps,
            "weight_pushes": self.sync.pushes,
            "elapsed_s": elapsed,
            "steps_per_s": state.finished_steps / elapsed,
            "samples_per_s": state.ledger.trained_count / elapsed,
            "max_lag": state.ledger.max_lag,
            "ledger": state.ledger.summary(),
            "busy": state.busy_fractions(),
            "exit": self.exit,
            "error": self.error,
        }

    async def _supervise(self) -> None:
        pumps = [
            asyncio.create_task(self.rollout.run(), name="rollout pump"),
            asyncio.create_task(self.train.run(), name="train pump"),
            asyncio.create_task(self.sync.run(), name="sync pump"),
        ]
        if self.lease is not None:
            pumps.append(asyncio.create_task(self.lease.run(), name="lease pump"))
        watchdog = asyncio.create_task(self.watchdog.run(), name="watchdog")
        try:
            while not all(task.done() for task in pumps):
                running = {task for task in pumps if not task.done()}
                done, _ = await asyncio.wait(running | {watchdog}, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
        finally:
            leftovers = pumps + [watchdog] + list(self.rollout.tasks)
            for task in leftovers:
                task.cancel()
            await asyncio.gather(*leftovers, return_exceptions=True)
            await self.state.stages.abort_generation()  # the groups those tasks waited for end now

    async def _settle_leftovers(self) -> None:
        """Groups generated after the last step needed them end as run_finished."""
        state = self.state
        leftovers = state.buffer.groups()
        for group in leftovers:
            state.ledger.dropped(group.keys, outcomes.RUN_FINISHED)
            state.buffer.release(group.group_id)
        await state.clear([key for group in leftovers for key in group.keys] + state.take_pending_clear())
