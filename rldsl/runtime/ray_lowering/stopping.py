"""Stopping a run from outside: Ctrl-C (SIGINT), SIGTERM and SIGHUP.

A cluster scheduler (Slurm, Kubernetes) ends a job with SIGTERM and, a grace
period later (commonly 30 s), SIGKILL; a closed terminal sends SIGHUP. Each
of them stops a run as Ctrl-C does: the controllers stop at their next safe
point (the trainer call in flight completes, an open step is aborted), the
last finished step is checkpointed, summary.json is written, the journal,
the metrics and the trace are flushed, and the Ray this run started is
stopped. The exit code is the shell's for that signal: 130, 143, 129.

Everything happens within the grace period (``--grace``), counted from the
first signal: the checkpoint gets it less a reserve for the summary and
Ray's shutdown, and a timer ends the process with what is written once it
is over. A second signal during the stop skips the checkpoint; the summary
is still written. Ray's ``ray.init`` installs its own SIGTERM handler (it
exits at once); ``StopSignals`` is installed after it, so ours wins.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

DEFAULT_GRACE_S = 30.0  # what Slurm's KillWait and Kubernetes' terminationGracePeriodSeconds default to
_RESERVE_S = 10.0  # at most: kept after the checkpoint for summary.json, the trace and Ray's shutdown
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


def signal_name(signum: int) -> str:
    return _NAMES.get(signum, signal.Signals(signum).name)


class RunInterrupted(KeyboardInterrupt):
    """A stop signal, raised in the driver's main thread (as Ctrl-C raises KeyboardInterrupt)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 128 + self.signum)


def as_interrupt(error: KeyboardInterrupt) -> RunInterrupted:
    """A plain KeyboardInterrupt (no handler of ours installed) is a Ctrl-C."""
    return error if isinstance(error, RunInterrupted) else RunInterrupted(signal.SIGINT)


class StopSignals:
    """The stop handlers of the driver process, from ``install`` (after
    ``ray.init``) to ``restore``. The first signal starts the grace period
    and raises ``RunInterrupted``; a later one raises again, except inside
    ``shielded()``, where what must be written is being written."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.grace_s = grace_s
        self.first: int | None = None
        self.latest: int | None = None
        self.started: float | None = None
        self._previous: dict[int, object] = {}
        self._shielded = False
        self._backstop: threading.Timer | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only; a driver run elsewhere keeps Python's Ctrl-C
        for signum in EXIT_CODES:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._backstop is not None:
            self._backstop.cancel()

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.first or signal.SIGINT, 130)

    def interrupted(self, error: KeyboardInterrupt) -> RunInterrupted:
        """The stop ``error`` stands for: the first signal's (Ray may re-raise
        a plain KeyboardInterrupt in its place); starts the grace period if no
        handler of ours did."""
        if self.first is None:
            self._start(as_interrupt(error).signum)
        return RunInterrupted(self.first)

    def time_left(self, keep_s: float = 0.0) -> float:
        """Seconds of the grace period left, less ``keep_s``; no limit before a signal."""
        if self.started is None:
            return float("inf")
        return max(0.0, self.started + self.grace_s - keep_s - time.monotonic())

    def checkpoint_time_left(self) -> float:
        """What the safe point and the checkpoint may use: the grace period
        less a reserve for summary.json, the trace and Ray's shutdown."""
        return self.time_left(min(_RESERVE_S, self.grace_s / 3))

    def shield(self) -> None:
        """From now on signals are noted, not raised (the run is shutting down)."""
        self._shielded = True

    @contextlib.contextmanager
    def shielded(self):
        """Signals are noted, not raised: summary.json and the flushes complete."""
        before, self._shielded = self._shielded, True
        try:
            yield
        finally:
            self._shielded = before

    def _handle(self, signum: int, frame) -> None:
        self.latest = signum
        first = self.first is None
        if first:
            self._start(signum)
        if self._shielded:
            _say(f"{signal_name(signum)}{'' if first else ' again'}: already writing summary.json and stopping "
                 f"(at most {self.time_left():.0f}s more)")
            return
        raise RunInterrupted(signum)

    def _start(self, signum: int) -> None:
        self.first, self.started = signum, time.monotonic()
        self._backstop = threading.Timer(self.grace_s, self._give_up)
        self._backstop.daemon = True
        self._backstop.start()

    def _give_up(self) -> None:
        """The grace period is over and the stop has not finished: end now,
        with what is written (a scheduler's SIGKILL would come now anyway)."""
        _say(f"error: the grace period of {self.grace_s:g}s is over; exiting with what is written so far")
        sys.stderr.flush()
        os._exit(self.exit_code)


def stop_pipelines(running: list, signals: StopSignals, interrupt: RunInterrupted, resume_command: str) -> int:
    """The graceful stop of every running pipeline (PipelineDriver); returns the exit code."""
    again = "a second Ctrl-C" if interrupt.signum == signal.SIGINT else "a second signal"
    _say(f"{interrupt}: stopping after the trainer call in flight, then a checkpoint, within "
         f"{signals.grace_s:g}s ({again} skips the checkpoint)")
    saved: set[str] = set()
    try:
        for pipeline in running:
            pipeline.request_stop()
        stopped = _wait_for_safe_points(running, signals)
        for pipeline in running:
            pipeline.drain_steps(timeout_s=max(1.0, signals.checkpoint_time_left()))
        for pipeline in stopped:  # one after the other: pipelines that took turns on GPUs have all given them back
            if checkpoint_at_stop(pipeline, resume_command, signals):
                saved.add(pipeline.pipe.name)
    except KeyboardInterrupt:  # the second signal (Ray may raise it as a plain KeyboardInterrupt)
        _say(f"{signal_name(signals.latest or interrupt.signum)} again: no checkpoint; writing summary.json and "
             "stopping")
    except Exception as error:  # noqa: BLE001 - Ray going down under us: the summary still gets written
        _say(f"interrupted: the stop could not finish its checkpoint ({type(error).__name__}: {error})")
    with signals.shielded():
        for pipeline in running:
            _write_what_is_left(pipeline, signals, interrupt, resume_command)
            if pipeline.pipe.name not in saved:
                _say_what_resumes(pipeline, resume_command)
    return signals.exit_code


def _say_what_resumes(pipeline, resume_command: str) -> None:
    """After a stop without a new checkpoint: the one a resume would start from, if any."""
    from rldsl.runtime.ray_lowering.checkpoint import latest_complete

    found = latest_complete(pipeline.run_dir)
    if found is not None:
        pipeline.tell(f"interrupted: `{resume_command}` continues from {found.name}")
    else:
        pipeline.say("interrupted: no complete checkpoint, so the run cannot be resumed")


def _wait_for_safe_points(running: list, signals: StopSignals) -> list:
    """The pipelines whose controller reached its safe point within the checkpoint's share of the grace period."""
    import ray

    refs = {pipeline.result_ref: pipeline for pipeline in running}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=signals.checkpoint_time_left())
    late = [p.pipe.name for ref, p in refs.items() if ref not in ready]
    if late:
        _say(f"interrupted: {', '.join(late)} did not reach a safe point within the grace period; no checkpoint "
             "for it")
    return [refs[ref] for ref in ready]


def checkpoint_at_stop(pipeline, resume_command: str, signals: StopSignals) -> bool:
    """At the controller's safe point: every trainer rank saves the last
    finished step, then the progress. True when a checkpoint was saved."""
    import ray

    from rldsl.runtime.ray_lowering.supervision import root_cause

    try:
        ray.get(pipeline.result_ref, timeout=0)
    except ray.exceptions.RayError as err:
        pipeline.say(f"interrupted; the run failed while stopping: {root_cause(err)}")
        return False
    trainers = pipeline.handles[pipeline.pipe.batch.train_stage]
    try:
        if not ray.get(trainers[0].can_checkpoint.remote(), timeout=signals.checkpoint_time_left()):
            pipeline.say(f"interrupted: the {pipeline.trainer_engine} trainer keeps no checkpoints")
            return False
        version = ray.get([t.save_checkpoint.remote() for t in trainers], timeout=signals.checkpoint_time_left())[0]
        saved = ray.get(pipeline.controller.save_progress.remote(version, max(0.1, signals.checkpoint_time_left())),
                        timeout=signals.checkpoint_time_left() + 1)
    except ray.exceptions.GetTimeoutError:
        pipeline.say("interrupted: the checkpoint did not finish within the grace period; the last complete "
                     "checkpoint stays the one to resume from")
        return False
    if saved:
        pipeline.tell(f"interrupted: checkpoint saved at version {version}; continue with `{resume_command}`")
    else:
        pipeline.say("interrupted before a step finished in this run: nothing new to checkpoint")
    return saved


def _write_what_is_left(pipeline, signals: StopSignals, interrupt: RunInterrupted, resume_command: str) -> None:
    """The steps not yet recorded, summary.json and the metrics' flush, each bounded by the grace period."""
    budget = max(1.0, signals.time_left(keep_s=3.0) / 2)
    with contextlib.suppress(Exception):
        pipeline.drain_steps(timeout_s=budget)
    evaluations = {}
    with contextlib.suppress(Exception):
        evaluations = pipeline.finish_evaluations(timeout_s=budget / 2)
    pipeline.write_summary(stop=stop_record(pipeline, interrupt, resume_command), timeout_s=budget,
                           evaluations=evaluations)
    if pipeline.progress is not None:
        pipeline.progress.close()


def stop_record(pipeline, interrupt: RunInterrupted, resume_command: str) -> dict:
    """What summary.json says of a stop: the signal, and the command that
    resumes the run (None without a complete checkpoint)."""
    from rldsl.runtime.ray_lowering.checkpoint import latest_complete

    resumable = latest_complete(pipeline.run_dir) is not None
    return {"signal": signal_name(interrupt.signum), "resume": resume_command if resumable else None}


def resume_command(run_dir: Path, steps: int | None = None, address: str | None = None,
                   grace_s: float = DEFAULT_GRACE_S) -> str:
    """`rldsl run --resume RUN_DIR` with the flags the run was given that its plan.json does not keep."""
    parts = ["rldsl", "run", "--resume", shlex.quote(str(run_dir))]
    if steps is not None:
        parts += ["--steps", str(steps)]
    if address:
        parts += ["--address", shlex.quote(address)]
    if grace_s != DEFAULT_GRACE_S:
        parts += ["--grace", f"{grace_s:g}s"]
    return " ".join(parts)


def how_to_resume(run_dir: Path, plan, command: str) -> str:
    """The help line after a run that did not finish: the resume command,
    or why there is nothing to resume from yet."""
    from rldsl.runtime.ray_lowering.checkpoint import latest_complete

    many = len(plan.pipelines) > 1
    found = [latest_complete(run_dir / p.name if many else run_dir) for p in plan.pipelines]
    if all(found):
        return f"`{command}` continues from {', '.join(sorted({f.name for f in found}))}"
    every = [p.run.checkpoint_every for p in plan.pipelines if p.run.checkpoint_every]
    if not every:
        return "no checkpoint was written; set `run { checkpoint_every = N }` to make long runs resumable"
    return (f"no checkpoint was written yet: the run stopped before its first one (`run {{ checkpoint_every = "
            f"{min(every)} }}` saves after step {min(every)}); it has to start again")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
