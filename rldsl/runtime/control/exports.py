"""The weight export that closes each step: the host bucket cache, or
the rank-to-rank push itself, once per version.

Where the trainer's export may run beside its step's calls
(``StageHandles.export_overlaps``: torch, megatron and fsdp trainers), the export
runs while the next step fills and trains: its microbatches only read the
weights. Whatever changes them (an optimizer step, the step's finish, the
trainer's sleep) and the next export wait for it, so a version is never
pushed half old, half new; the generators take it at its last bucket, as
before. When the trainer takes turns with its generators the wake needs
the export: it stays in the step.
"""

from __future__ import annotations

import asyncio

from rldsl.runtime.control.errors import WorkerLost, trainer_lost


class Exports:
    """The train pump's weight exports (mixed into ``TrainPump``)."""

    _export_task: asyncio.Task | None = None

    async def _start_export(self, version: int) -> None:
        """The new version's export: in the background when it may overlap the next step."""
        state = self.state
        await self._settle_export()
        if state.stages.export_overlaps and not state.settings.takes_turns:
            self._export_task = asyncio.ensure_future(self._export(version, overlapped=True))
        else:
            await self._export(version)

    async def _export(self, version: int, overlapped: bool = False) -> None:
        """Once per step, before anything reads the new version: the host
        bucket cache that pushes and refreshes serve, or the push itself
        (rank to rank). ``overlapped``: while the next step trains."""
        state = self.state
        if not overlapped:
            self.activity = f"exporting weights version {version} to the host bucket cache"
        state.receivers_incoming = max(state.receivers_incoming, version)  # a rank-to-rank export is the push
        try:
            await state.stages.export_weights(version)
        except WorkerLost as lost:
            raise trainer_lost(lost, "export_weights") from lost
        state.exported_version = version
        if not overlapped:
            self.activity = None
        state.progress()

    async def _settle_export(self) -> None:
        """An export still running ends before anything changes the weights
        it reads; its failure is raised here."""
        task = self._export_task
        if task is None:
            return
        activity = self.activity
        self.activity = f"waiting for the export of weights version {self.state.trainer_version}"
        try:
            await task
        finally:
            self._export_task = None
            self.activity = activity

    def _forget_export(self) -> None:
        """The pump ends on a failure or cancellation: an export still running is called off."""
        task, self._export_task = self._export_task, None
        if task is None:
            return
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: the failure that ends the pump is the one reported
        else:
            task.cancel()
