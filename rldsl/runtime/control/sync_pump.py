"""The sync pump: pushes the trainer's weights to the generators after each step."""

from __future__ import annotations

from rldsl.runtime.control.state import RunState


class SyncPump:
    """After each finished step: drain generation, push weights, resume.

    Generators swap weights only between groups, so dispatch pauses while
    groups already mid-generation finish; reward and logprob stages, and the
    trainer, keep running. Steps that finish during a push coalesce into one
    push of the newest version."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.pushes = 0
        self.phase = "idle"

    async def run(self) -> None:
        state = self.state
        while True:
            if state.generator_version >= state.trainer_version:
                if state.training_done:
                    self.phase = "done"
                    return
                self.phase = "idle"
                await state.changed.wait()
                continue
            target = state.trainer_version
            state.sync_pending = True
            state.changed.notify()
            while state.generating > 0:
                self.phase = f"waiting for {state.generating} groups mid-generation before pushing version {target}"
                await state.changed.wait()
            self.phase = f"pushing weights version {target}"
            state.pushing = True
            with state.meter("sync").track():
                await state.stages.push_weights(target)
            state.generator_version = target
            state.sync_pending = state.pushing = False
            self.pushes += 1
            state.progress()
