"""Taking turns on GPUs: the trainer and the generator replicas on its GPUs
(colocated, or GPUs leased from other pipelines) swap between steps.

The train pump owns the step; this part of it decides when the generators on
the trainer's GPUs sleep, when the trainer takes its GPUs (and lease) and
when it gives them back. It reads ``self.state`` and reports what it waits
for in ``self.activity`` (the watchdog's text), as the pump does.
"""

from __future__ import annotations

from rldsl.runtime.control.buffer import GroupState
from rldsl.runtime.control.errors import WorkerLost
from rldsl.runtime.control.leases import TRAIN

TRAINER_HOLDER = "trainer"  # the trainer's name with the lease scheduler


class GpuTurns:
    """The train pump's GPU hand-overs (mixed into ``TrainPump``)."""

    async def _generation_phase(self, step) -> None:
        """The step starts once all its groups are ready and the generator
        replicas on the trainer's GPUs are idle; those then sleep (or give
        their leases back) until it finishes, and the trainer takes its GPUs.
        From the moment the step's groups are all dispatched those replicas
        take no new groups; the others keep generating."""
        state, per_step = self.state, self.state.settings.prompts_per_step
        sleepers = state.sleepers()
        self.activity = "colocated: waiting for the step's groups before the generators on its GPUs sleep"
        while True:
            covered = state.prompts_exhausted or state.buffer.outstanding + state.consumed_in_step >= per_step
            if covered != state.draining_sleepers:
                state.draining_sleepers = covered
                state.changed.notify()
            ready = (state.sampler.count_eligible(state.buffer, state.trainer_version, step.batch_index) >= per_step
                     or (state.prompts_exhausted and state.buffer.count(GroupState.RESERVED) == 0))
            if ready and all(r.in_flight == 0 and not r.receiving for r in sleepers):
                break
            await self._wait_unless_stopped()
        for replica in sleepers:
            replica.asleep = True
        state.changed.notify()
        if sleepers:
            self.activity = "colocated: putting the generators on the trainer's GPUs to sleep"
            try:
                await state.stages.sleep_generators([r.index for r in sleepers])
            except WorkerLost as lost:  # a replica that is gone holds no GPU memory either
                state.lose_replica(lost)
        await self._take_trainer_gpus()
        self.activity = None

    async def _take_trainer_gpus(self) -> None:
        """The trainer's GPU lease (when it shares them with other pipelines),
        then its state back onto them."""
        state = self.state
        if state.settings.trainer_lease:
            self.activity = f"waiting for the lease of GPUs {', '.join(state.settings.trainer_lease)}"
            await state.acquire_lease(TRAINER_HOLDER, state.settings.trainer_lease, TRAIN)
        self.activity = "taking the trainer's GPUs back from generation"
        state.trainer_resident = True
        await state.stages.wake_trainer()

    async def _wake_generators(self) -> None:
        """The trainer offloads and gives its lease back; replicas it put to
        sleep wake, refreshed from the host bucket cache (leased replicas
        wake through their own leases, lease_pump.py)."""
        state = self.state
        if state.trainer_resident:
            self.activity = "offloading the trainer for generation"
            await state.stages.sleep_trainer()
            state.trainer_resident = False
        if state.settings.trainer_lease:
            await state.leases.release(TRAINER_HOLDER)  # only once its memory is released
        asleep = [r for r in state.replicas if r.asleep and not r.leased]
        if asleep:
            self.activity = f"colocated: waking the generators, refreshed to version {state.exported_version}"
            try:
                await state.stages.wake_generators([r.index for r in asleep], state.exported_version)
            except WorkerLost as lost:
                state.lose_replica(lost)
            for replica in asleep:
                replica.asleep = False
                replica.version = max(replica.version, state.exported_version)
        self.activity = None
        state.draining_sleepers = False
        state.changed.notify()
