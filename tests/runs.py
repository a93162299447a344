"""Running `rldsl` from a test.

``rldsl(ARGS)`` runs ``python -m rldsl ARGS`` in a subprocess, as a user
would: for tests whose subject is the process (exit codes on signals, a
killed driver, start-up, what a fresh interpreter imports).

``rldsl_here(ARGS)`` runs the same command line in this process, through the
CLI's own entry point, on the test session's shared Ray and TransferQueue
(``shared_ray``): a run then pays for its actors only, not for starting
Python, importing the runtime, starting Ray and TransferQueue and stopping
them again (about 9 s of a 2-step run's 25 s on a 2-core machine). The
command line, the exit code, stdout and stderr are those of the subprocess.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One generator replica, one trainer rank and one reward worker: for a run whose subject is not several of
# them. A run's start is mostly its actors importing torch, Ray and TransferQueue (about 1.7 s each on 2
# cores), so `sim_async` this way (6 actors, not 10) starts in half the time.
LEAN_SIM_ASYNC_SETTINGS = ("rollout.gpus=1", "actor.gpus=1", "score.workers=1")
LEAN_SIM_ASYNC = tuple(arg for setting in LEAN_SIM_ASYNC_SETTINGS for arg in ("--set", setting))


LEAN_SIM_CHAOS = ("--set", "rollout.gpus=[0]", "--set", "score.workers=1")  # lean_chaos, from the command line


def lean_chaos(text: str) -> str:
    """`sim_chaos.rlp`'s text with one generator replica and one reward worker (6 actors, not 8)."""
    lean = text.replace("gpus = [0, 1]", "gpus = [0]").replace("workers = 2", "workers = 1")
    assert lean.count("gpus = [0]") == 1 and "workers = 1" in lean, "sim_chaos.rlp changed: update lean_chaos"
    return lean


SHARED_CPUS = 24  # logical: every test pipeline's actors (0.25 each) and TransferQueue (1 each)
SHARED_GPUS = 8  # logical: the largest test pipeline's placement
_shared: dict = {}  # the session's Ray and the data plane that keeps TransferQueue up


def rldsl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m rldsl ARGS`` in the repository root, output captured."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "rldsl", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


def rldsl_here(*args: str, err: io.StringIO | None = None) -> subprocess.CompletedProcess:
    """``rldsl ARGS`` in this process, in the repository root, on the shared Ray; output captured
    (stderr into ``err`` if given, which another thread may read while the command runs)."""
    from rldsl.cli import main

    if args[:1] == ("run",):
        shared_ray()
    out, err = io.StringIO(), err if err is not None else io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(["rldsl", *args], code, out.getvalue(), err.getvalue())


def signalled_here(args: list[str], signals: list, err: io.StringIO, timeout_s: float = 300):
    """`rldsl ARGS` in this process; each ``(condition, signum)`` in turn sent
    to this process once its condition holds. Until the run has installed its
    handlers, and after it restored them, those signals are ignored here."""
    sent = []

    def send() -> None:
        deadline = time.monotonic() + timeout_s
        for condition, signum in signals:
            while not condition():
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            os.kill(os.getpid(), signum)
            sent.append(signum)

    previous = {signum: signal.signal(signum, lambda *_: None) for _, signum in signals}
    sender = threading.Thread(target=send, daemon=True)
    try:
        sender.start()
        result = rldsl_here(*args, err=err)
        sender.join(timeout=5)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return result, sent


def run_text(tmp_path: Path, text: str, *args: str, name: str = "p.rlp"):
    """``rldsl run`` (in this process) of a pipeline written as ``text``, which must succeed:
    (the finished process, its run directory, its summary.json)."""
    source, run_dir = tmp_path / name, tmp_path / "run"
    source.write_text(text)
    run = rldsl_here("run", str(source), "--run-dir", str(run_dir), *args)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, run_dir, json.loads((run_dir / "summary.json").read_text())


def shared_ray():
    """The test session's local Ray (started on first use, as `rldsl run`
    starts one) with TransferQueue up; a test that connected this process to
    another Ray meanwhile loses that connection here."""
    import ray

    from rldsl.runtime.dataplane import connect_dataplane
    from rldsl.runtime.ray_lowering.cluster import start_ray

    session = _shared.get("session")
    if session is not None and ray.is_initialized() and ray.get_runtime_context().gcs_address == session.address:
        return session
    release_shared_ray()
    if ray.is_initialized():
        ray.shutdown()
    session = start_ray(num_cpus=SHARED_CPUS, num_gpus=SHARED_GPUS, namespace="rldsl-tests")
    _shared["session"] = session
    _shared["dataplane"] = connect_dataplane({"backend": "transferqueue", "storage_units": 1})
    return session


def release_shared_ray() -> None:
    """Stop the shared Ray, if it runs (before a test starts a Ray of its own in this process)."""
    plane, session = _shared.pop("dataplane", None), _shared.pop("session", None)
    if plane is not None:
        with contextlib.suppress(Exception):
            plane.close()
    if session is not None:
        session.shutdown()
