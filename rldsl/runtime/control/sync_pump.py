"""The sync pump: brings the weight receivers up to the exported version."""

from __future__ import annotations

from rldsl.runtime.control.errors import WorkerLost
from rldsl.runtime.control.state import GeneratorReplica, RunState


class SyncPump:
    """After each finished step the train pump exports the weights once into
    the host bucket cache; this pump pushes that version to every awake
    generator replica that is behind, and to the other receivers.

    Nothing waits for it: a replica stages the buckets while it keeps
    generating and swaps them in between two batches (its groups then carry
    the new version), dispatch goes on, and the trainer starts the next
    step. Sleeping replicas are skipped: they are refreshed from the cache
    when they wake. Steps that finish during a push coalesce into one push
    of the newest version."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.pushes = 0
        self.phase = "idle"

    async def run(self) -> None:
        state = self.state
        while True:
            target = state.exported_version
            behind = self._behind(target)
            if not behind and state.receivers_version >= target:
                if state.training_done:
                    self.phase = "done"
                    return
                self.phase = "idle"
                await state.changed.wait()
                continue
            await self._push(target, behind)

    def _behind(self, target: int) -> list[GeneratorReplica]:
        return [r for r in self.state.replicas
                if not r.lost and not r.asleep and not r.receiving and r.version < target]

    async def _push(self, target: int, replicas: list[GeneratorReplica]) -> None:
        state = self.state
        names = ", ".join(str(r.index) for r in replicas) or "none"
        self.phase = f"pushing weights version {target} to generator replicas {names}"
        for replica in replicas:
            replica.receiving = True
        state.receivers_incoming = max(state.receivers_incoming, target)  # from now on they may hold it
        try:
            with state.meter("sync").track():
                await state.stages.push_weights(target, [r.index for r in replicas])
        except WorkerLost as lost:  # that receiver is gone; the others got the version
            state.lose_replica(lost)
        finally:
            for replica in replicas:
                replica.receiving = False
        for replica in replicas:
            replica.version = max(replica.version, target)
        state.receivers_version = max(state.receivers_version, target)
        self.pushes += 1
        state.progress()
