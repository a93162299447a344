"""The reaper: no process of a local Ray outlives the run that started it.

``rldsl run`` starts its local Ray inside the driver process, so Ray's head
processes (GCS, raylet, their helpers) are the driver's children and the
workers and agents theirs. A driver killed with SIGKILL never shuts Ray
down, and even a clean ``ray.shutdown()`` ends the raylet before its agents,
which then linger for about a minute. The reaper is a small process of its
own session (a signal to the driver does not reach it) that, while the
driver and Ray's head processes live, keeps a list of every process under
those; once the driver is gone or Ray has shut down, it sends each one still
alive SIGTERM, then SIGKILL after a short wait, and exits. It touches only
those processes (a pid is checked against its start time, so a reused pid
is never hit).

    python -m rldsl.runtime.ray_lowering.reaper DRIVER_PID HEAD_PID...
"""

from __future__ import annotations

import subprocess
import sys
import time

POLL_S = 0.5  # how often it looks at the driver and lists Ray's processes
TERM_WAIT_S = 3.0  # between SIGTERM and SIGKILL


def start_reaper() -> subprocess.Popen | None:
    """The reaper of the local Ray just started in this process (its head
    processes name the session directory in their command lines); None
    without psutil, which it needs to follow the processes."""
    import os

    try:
        import psutil
        from ray._private import worker

        session_dir = worker._global_node.get_session_dir_path()  # Ray keeps no public name for it
    except (ImportError, AttributeError):
        return None
    marker = os.path.basename(session_dir.rstrip("/"))
    heads = [str(child.pid) for child in psutil.Process().children()
             if marker in " ".join(_cmdline(child))]
    if not heads:
        return None
    return subprocess.Popen([sys.executable, "-m", "rldsl.runtime.ray_lowering.reaper", str(os.getpid()), *heads],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _cmdline(process) -> list[str]:
    try:
        return process.cmdline()
    except Exception:  # noqa: BLE001 - gone or not ours to read: not a Ray head process
        return []


def reap(driver_pid: int, head_pids: list[int]) -> int:
    """Follow Ray's processes while the driver and a head live; end them once
    either is gone. How many it ended."""
    import psutil

    known: dict[int, float] = {}  # pid -> its start time
    heads = [_process(pid) for pid in head_pids]
    heads = [head for head in heads if head is not None]
    while _alive(driver_pid) and any(_alive(head.pid) for head in heads):
        _remember(known, _under(heads))
        time.sleep(POLL_S)
    _remember(known, _under(heads))  # the last look: what the heads still alive started meanwhile
    victims = [p for pid, started in known.items() if (p := _process(pid)) is not None and _same(p, started)]
    for process in victims:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(victims, timeout=TERM_WAIT_S)
    for process in left:
        try:
            process.kill()
        except psutil.Error:
            pass
    return len(victims)


def _under(heads: list) -> list:
    """The heads and every process under them, from one scan of the process
    table (``Process.children`` scans it once per call: once per head)."""
    import psutil

    children: dict[int, list] = {}
    for process in psutil.process_iter(["ppid"]):
        children.setdefault(process.info["ppid"], []).append(process)
    found, todo = [], [head for head in heads if head.is_running()]  # a head's pid reused: not ours
    while todo:
        process = todo.pop()
        found.append(process)
        todo.extend(children.get(process.pid, []))
    return found


def _remember(known: dict[int, float], processes) -> None:
    """Each new pid with its start time (read once: a pid seen before keeps its first)."""
    import psutil

    for process in processes:
        if process.pid in known:
            continue
        try:
            known[process.pid] = process.create_time()
        except psutil.Error:
            pass


def _process(pid: int):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _same(process, started: float) -> bool:
    import psutil

    try:
        return process.is_running() and process.create_time() == started
    except psutil.Error:
        return False


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


if __name__ == "__main__":
    reap(int(sys.argv[1]), [int(pid) for pid in sys.argv[2:]])
