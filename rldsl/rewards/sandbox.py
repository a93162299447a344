"""Run untrusted Python (a model's answer to a code task) with limits.

``run_python(code, stdin, timeout, memory)`` runs ``code`` in a fresh
interpreter and returns a ``SandboxResult``. What is guaranteed, and on
which platform, is in docs/runtime.md ("The code sandbox"); in short (Linux):

- a new temporary working directory, deleted afterwards; an empty
  environment but for ``PATH``, ``LANG`` and ``HOME`` (that directory);
  Python in isolated mode (no ``PYTHON*`` variables, no user site);
- limits (``resource``): address space (``memory``), CPU seconds, size of
  any file written (stdout and stderr are files too, so output is capped),
  processes, no core files;
- no network: a network namespace of its own (no interface but a down
  loopback) where the kernel allows one (root, or unprivileged user
  namespaces), and always an audit hook that refuses Python's internet
  sockets;
- started as root, it runs as a user id of its own, so the process limit
  holds (root ignores it), it cannot signal or read what root owns, and
  every process it started is killed at the end, wherever it went;
- killed with its whole process group at the timeout (and at its end, so a
  background child does not outlive it).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY = 512 * 2**20  # bytes of address space; the interpreter itself takes about 30 MiB of it
DEFAULT_OUTPUT = 1 * 2**20  # bytes of stdout, of stderr and of any file the program writes
DEFAULT_PROCESSES = 16  # processes and threads the program may add
SANDBOX_UID_BASE = 3_000_000  # root starts each program under a user id of its own from here
_SANDBOX_UIDS = 1_000_000
_BOOT_SOURCE = (Path(__file__).with_name("sandbox_boot.py")).read_text()
_MEMORY_MARK = "MemoryError"
_run_numbers = itertools.count()
# as the sandbox user: kill all its processes, and once more a moment later (in case one was forking)
_KILL_ALL = """import os, signal, time
os.setgid({uid}); os.setuid({uid})
for attempt in range(2):
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        break
    time.sleep(0.02)
"""


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None  # negative: killed by that signal; None: killed at the timeout
    stdout: str
    stderr: str
    timed_out: bool
    memory_exceeded: bool
    network: str  # how the network was cut: "namespace", "user_namespace" or "audit_hook"

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxError(RuntimeError):
    """The sandbox itself could not start (not the program's failure)."""


def run_python(code: str, stdin: str = "", timeout: float = DEFAULT_TIMEOUT_S, memory: int = DEFAULT_MEMORY,
               output: int = DEFAULT_OUTPUT, processes: int = DEFAULT_PROCESSES,
               argv: tuple[str, ...] = ()) -> SandboxResult:
    """Run ``code`` as ``main.py`` with ``stdin``, under the limits above.

    ``timeout`` is wall-clock seconds (CPU time is limited to it too);
    ``memory`` bytes of address space; ``output`` bytes per output stream
    and written file; ``processes`` processes (and threads) beyond those
    its user already has.
    """
    uid = _sandbox_uid()
    with tempfile.TemporaryDirectory(prefix="rldsl-sandbox-") as scratch:
        work = Path(scratch, "work")
        work.mkdir()
        (work / "main.py").write_text(code, encoding="utf-8")
        streams = [Path(scratch, name) for name in ("stdin", "stdout", "stderr")]
        streams[0].write_text(stdin, encoding="utf-8")
        if uid is not None:  # it may pass through the scratch directory to its own, and own only that
            os.chmod(scratch, 0o711)
            for path in (work, work / "main.py"):
                os.chown(path, uid, uid)
            for path in streams:
                path.touch(mode=0o600)
        config = {"network": network_isolation(), "uid": uid, "argv": list(argv),
                  "limits": _limits(timeout, memory, output, processes, uid)}
        with open(streams[0], "rb") as into, open(streams[1], "wb") as out, open(streams[2], "wb") as err:
            command = [sandbox_interpreter() or sys.executable, "-I", "-X", "utf8", "-c", _BOOT_SOURCE,
                       json.dumps(config)]
            exit_code, timed_out = _run(command, work, uid, timeout, (into, out, err))
        stdout, stderr = (_read(path, output) for path in streams[1:])
    if exit_code == 125 and stderr.startswith("sandbox: "):
        raise SandboxError(stderr.strip())
    memory_exceeded = _MEMORY_MARK in (stderr.rstrip().splitlines() or [""])[-1]
    return SandboxResult(exit_code, stdout, stderr, timed_out, memory_exceeded, config["network"])


def _run(command: list[str], cwd: Path, uid: int | None, timeout: float, streams) -> tuple[int | None, bool]:
    try:
        process = subprocess.Popen(command, cwd=cwd, env=_clean_env(cwd), stdin=streams[0], stdout=streams[1],
                                   stderr=streams[2], start_new_session=True)
    except OSError as error:
        raise SandboxError(f"cannot start the sandbox's interpreter: {error}") from error
    try:
        return process.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        return None, True
    finally:
        _kill_everything(process, uid)


def _kill_everything(process: subprocess.Popen, uid: int | None) -> None:
    """The program's process group, and with a sandbox user id every process of that user."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:  # kill(-1) as that user reaches every process it owns (not only its group)
        subprocess.run([sandbox_interpreter(), "-I", "-S", "-c", _KILL_ALL.format(uid=uid)], check=False,
                       stderr=subprocess.DEVNULL, timeout=30)
    process.wait()


def _limits(timeout: float, memory: int, output: int, processes: int, uid: int | None) -> dict:
    import resource

    limits = {"RLIMIT_AS": int(memory), "RLIMIT_CPU": max(1, math.ceil(timeout)) + 1,
              "RLIMIT_FSIZE": int(output), "RLIMIT_CORE": 0}
    if hasattr(resource, "RLIMIT_NPROC"):  # counted per user: a fresh sandbox user starts from zero
        limits["RLIMIT_NPROC"] = processes + (1 if uid is not None else _tasks_of(os.getuid()))
    return limits


def _tasks_of(uid: int) -> int:
    """Processes and threads ``uid`` runs now (what RLIMIT_NPROC counts)."""
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _sandbox_uid() -> int | None:
    """A user id of its own for each program when running as root on Linux
    (and an interpreter that user can run: see ``sandbox_interpreter``)."""
    if not _runs_as_root() or not _uid_range_mapped() or sandbox_interpreter() is None:
        return None
    return SANDBOX_UID_BASE + (os.getpid() * 1000 + next(_run_numbers)) % _SANDBOX_UIDS


def _runs_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


@functools.cache
def sandbox_interpreter() -> str | None:
    """The Python that programs run with: this one; as root, this one if a
    sandbox user can read its standard library (a Python installed under
    root's home cannot), else the system's ``python3``; None when neither
    can (programs then run as root, and the process limit does not hold)."""
    if not _runs_as_root():
        return sys.executable
    candidates = dict.fromkeys(filter(None, [sys.executable, shutil.which("python3", path=os.defpath)]))
    probe = f"import os; os.setgid({SANDBOX_UID_BASE}); os.setuid({SANDBOX_UID_BASE}); import json, runpy, ctypes"
    for python in candidates:
        try:
            if subprocess.run([python, "-I", "-c", probe], timeout=30, check=False, cwd="/",
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
                return python
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


@functools.cache
def _uid_range_mapped() -> bool:
    """Whether this (possibly user-namespaced) root may take the sandbox user ids."""
    try:
        rows = [line.split() for line in Path("/proc/self/uid_map").read_text().splitlines()]
    except OSError:
        return False
    end = SANDBOX_UID_BASE + _SANDBOX_UIDS
    return any(int(first) <= SANDBOX_UID_BASE and end <= int(first) + int(count) for first, _, count in rows)


@functools.cache
def network_isolation() -> str:
    """How this machine can cut a program off the network: ``namespace``
    (root), ``user_namespace`` (unprivileged user namespaces), or only the
    ``audit_hook`` (Python's sockets refused; not other programs)."""
    if not sys.platform.startswith("linux"):
        return "audit_hook"
    for how, flags in (("namespace", 0x40000000), ("user_namespace", 0x50000000)):
        probe = f"import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare({flags}) != 0)"
        try:
            if subprocess.run([sys.executable, "-I", "-S", "-c", probe], timeout=30, check=False,
                              stderr=subprocess.DEVNULL).returncode == 0:
                return how
        except (OSError, subprocess.TimeoutExpired):
            break
    return "audit_hook"


def _clean_env(home: Path) -> dict:
    return {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": str(home)}


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as stream:
        return stream.read(limit).decode("utf-8", errors="replace")
