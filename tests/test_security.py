"""Local runs stay local; clusters keep their own authentication.

A local `rldsl run` is watched while it runs: every listening socket of
every process of it (psutil) must be bound to loopback. A cluster with
token authentication refuses a client without its token, and rldsl says
so plainly.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
ray = pytest.importorskip("ray")

from tests.runs import LEAN_SIM_CHAOS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray]


def user_env(**overrides) -> dict:
    """The environment a user runs with: Ray's authentication as Ray sets it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    return {**env, **overrides}


def listening_sockets(root_pid: int) -> dict[tuple[str, int], str]:
    found = {}
    try:
        processes = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for process in processes:
        try:
            for connection in process.net_connections(kind="inet"):
                if connection.status == psutil.CONN_LISTEN:
                    found[(connection.laddr.ip, connection.laddr.port)] = process.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _descendants(pid: int) -> list:
    """Every process under ``pid`` now, with its start time (a reused pid is not the same process)."""
    out = []
    for process in psutil.Process(pid).children(recursive=True):
        try:
            out.append((process, process.create_time()))
        except psutil.NoSuchProcess:
            continue
    return out


def _still(process, started: float) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE and process.create_time() == started
    except psutil.NoSuchProcess:
        return False


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_a_local_run_listens_on_loopback_only_keeps_its_files_private_and_leaves_no_process(tmp_path):
    """Watched while it trains, then killed with SIGKILL: no process of its
    Ray is alive 10 s later (its reaper ends them)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rldsl", "run", "pipelines/sim_chaos.rlp", "--steps", "200",
                             *LEAN_SIM_CHAOS, "--run-dir", str(run_dir)], cwd=ROOT, env=user_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sockets: dict[tuple[str, int], str] = {}
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        sockets.update(listening_sockets(proc.pid))
        if metrics.exists() and metrics.read_text().count('"lag_histogram"') >= 3:
            break
        time.sleep(1.0)
    assert proc.poll() is None, proc.communicate()[1][-3000:]  # still training
    run_processes = _descendants(proc.pid)
    proc.kill()  # SIGKILL: the driver shuts nothing down itself
    _, err = proc.communicate(timeout=60)
    assert "Token authentication is enabled" not in err  # Ray's default, not repeated on every run
    assert len(sockets) >= 10, sockets  # Ray's services, every worker, TransferQueue: the listing saw the run
    exposed = {f"{ip}:{port}": name for (ip, port), name in sockets.items() if not is_loopback(ip)}
    assert not exposed, f"listening beyond loopback: {exposed}"
    gone_by = time.monotonic() + 10
    while (alive := [f"{p.pid} {p.name()}" for p, started in run_processes if _still(p, started)]) \
            and time.monotonic() < gone_by:
        time.sleep(0.5)
    assert not alive, f"alive 10 s after SIGKILL of rldsl run: {alive}"
    assert stat.S_IMODE(run_dir.stat().st_mode) & 0o077 == 0
    token_file = Path.home() / ".ray" / "auth_token"
    if token_file.exists():
        token = token_file.read_text().strip()
        leaked = [p for p in run_dir.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
        assert not leaked


def test_a_cluster_that_needs_a_token_gets_a_clear_answer(tmp_path):
    import signal
    import socket

    token = "rldsl-test-token-0123456789abcdef"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # a cluster of its own, in its own process group: ended by that group's id, nothing else
    head = subprocess.Popen(["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=4", "--num-gpus=4",
                             "--include-dashboard=false"], env=user_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)

        def dry_run(**env):
            return subprocess.run([sys.executable, "-m", "rldsl", "run", "pipelines/sim_chaos.rlp", "--address",
                                   f"127.0.0.1:{port}", "--dry-run"], cwd=ROOT, env=user_env(**env),
                                  capture_output=True, text=True, timeout=300)

        missing = dry_run(RAY_AUTH_MODE="disabled")
        assert missing.returncode == 2, missing.stderr[-3000:]
        assert "requires token authentication and no token was found here" in missing.stderr
        wrong = dry_run(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-the-token-0123456789abcdef")
        assert wrong.returncode == 2 and "refused the authentication token found here" in wrong.stderr
        right = dry_run(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        assert right.returncode == 0, right.stderr[-3000:]
        assert "Traceback" not in missing.stderr + wrong.stderr
    finally:  # the whole group at once (`ray start --block` takes ~30 s to stop on SIGTERM)
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=60)
