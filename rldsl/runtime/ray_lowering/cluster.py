"""Lowering a plan onto Ray: start or join a cluster (placement.py reserves its resources).

Resource accounting is logical. Ray's CPU count is only a scheduling budget,
so we give Ray at least ``DEFAULT_LOGICAL_CPUS`` of them whatever the machine
has: TransferQueue's controller and storage units each claim a whole CPU, and
on a 2-CPU Ray ``tq.init`` would wait forever. Our own actors ask for
``ACTOR_NUM_CPUS`` (a fraction) for the same reason. GPUs may be logical
too: a CPU machine can start Ray with ``num_gpus=2`` for tests.

Every failure here is meant to be read by a person: which address could not
be reached and what to check; which resource a placement group lacks.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

DEFAULT_LOGICAL_CPUS = 8
ACTOR_NUM_CPUS = 0.25  # what our engine and controller actors request
DEFAULT_CONNECT_TIMEOUT_S = 10.0
_local_gcs: str | None = None  # the GCS of the local Ray start_ray started in this process, while it runs


class ClusterError(RuntimeError):
    """Ray could not be started or reached, or resources cannot be reserved."""


def transferqueue_cpus(storage_units: int = 1) -> int:
    """Whole logical CPUs TransferQueue claims: its controller + storage units."""
    return 1 + storage_units


def logical_cpus_needed(actor_cpus: float = 0.0, storage_units: int = 1) -> int:
    """Logical CPUs for a local Ray: our actors' fractional requests plus
    TransferQueue's, never fewer than ``DEFAULT_LOGICAL_CPUS``."""
    return max(DEFAULT_LOGICAL_CPUS, math.ceil(actor_cpus + transferqueue_cpus(storage_units)))


# ------------------------------------------------------------------ sessions


def loopback_env() -> dict[str, str]:
    """The environment of a local run that keeps every socket on loopback.

    Ray resolves its node address to the machine's routable one and serves
    on it; with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` it takes the loopback
    address instead (its own behaviour on macOS and Windows), and so do
    TransferQueue's sockets and our rendezvous, which ask Ray for the node
    address. gloo and NCCL pick their interface from ``*_SOCKET_IFNAME``.
    A variable the user has set is left as it is."""
    loopback = _loopback_interface()
    wanted = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    if loopback:
        wanted |= {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback}
    return wanted


def _ray_on_loopback() -> Callable[[], None]:
    """This process's Ray read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it was
    imported; the same switch for it now (private, checked on Ray 2.60).
    Returns what undoes it."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1") not in ("0", "false")

    def restore() -> None:
        ray_constants.ENABLE_RAY_CLUSTER = before

    return restore


def _loopback_interface() -> str | None:
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses):
            return name
    return None


def _set_environ(values: dict[str, str]) -> Callable[[], None]:
    """Set what the user has not set; returns what undoes it."""
    added = [name for name in values if name not in os.environ]
    for name in added:
        os.environ[name] = values[name]

    def restore() -> None:
        for name in added:
            os.environ.pop(name, None)

    return restore


@dataclass
class RaySession:
    """The Ray this process uses. ``started_here`` is true only when we
    launched a local instance; ``shutdown`` stops it then, and otherwise only
    disconnects (it never stops a cluster someone else started)."""

    address: str
    namespace: str
    started_here: bool
    connected_here: bool
    local: bool = False  # a Ray of this machine alone, started by rldsl: every plan node folds onto it
    _cleanups: list[Callable[[], Any]] = field(default_factory=list, repr=False)

    def add_cleanup(self, cleanup: Callable[[], Any]) -> None:
        """Run ``cleanup`` before Ray goes down (e.g. ``data_plane.close``);
        cleanups run last-added first."""
        self._cleanups.append(cleanup)

    def shutdown(self) -> None:
        import ray

        while self._cleanups:
            cleanup = self._cleanups.pop()
            try:
                cleanup()
            except Exception:  # one failing cleanup must not keep Ray running
                log.exception("cleanup %r failed during Ray shutdown", cleanup)
        if self.connected_here and ray.is_initialized():
            ray.shutdown()
            if self.started_here:
                _remember_local(None)
        self.connected_here = False


def start_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int = 0,
    namespace: str = "rldsl",
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> RaySession:
    """Start a local Ray (``address`` None or "local") or join the cluster at
    ``address`` ("host:port", "ray://host:port" or "auto").

    Locally: ``num_cpus`` logical CPUs (default ``logical_cpus_needed()``),
    ``num_gpus`` logical GPUs, no dashboard, worker logs not forwarded,
    every socket on loopback (``loopback_env``), and Ray's own authentication
    as RAY_AUTH_MODE says (token by default). When joining, the cluster's own
    resources and authentication apply and ``num_cpus``/``num_gpus`` are ignored.
    The address is probed over TCP first, so an unreachable one fails within
    ``connect_timeout_s`` (Ray alone retries for about two minutes, then exits
    the process); a port that accepts TCP but is no Ray GCS fails in Ray's
    own check after ~20 s, also as a ``ClusterError``. If Ray is already
    initialised in this process, that session is reused and left running.
    """
    import ray

    from rldsl.runtime.dataplane import transferqueue_env
    from rldsl.runtime.ray_lowering.actor_process import worker_setup_env

    if ray.is_initialized():  # e.g. a test session's Ray, shared by its runs: theirs to use, not to stop
        context = ray.get_runtime_context()
        local = address in (None, "", "local") and context.gcs_address == _local_gcs  # an address: a cluster's ways
        return RaySession(context.gcs_address, context.namespace, False, False, local=local)
    env = {**transferqueue_env(), **worker_setup_env()}  # worker processes inherit it (see dataplane)
    if address in (None, "", "local"):
        undo = _on_loopback(env)  # worker processes inherit the environment
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_DEFAULT_AUTH_NOTICE)
        cpus = logical_cpus_needed() if num_cpus is None else num_cpus
        try:
            ray.init(
                address="local",  # never RAY_ADDRESS: a local start was asked for
                num_cpus=cpus,
                num_gpus=num_gpus,
                namespace=namespace,
                include_dashboard=False,
                log_to_driver=False,
            )
        except BaseException as error:  # e.g. Ctrl-C half-way: do not leave a half-started Ray behind
            ray.shutdown()
            for restore in reversed(undo):
                restore()
            if isinstance(error, Exception):
                raise ClusterError(_local_start_failure(error)) from None
            raise
        _remember_local(ray.get_runtime_context().gcs_address)
        from rldsl.runtime.ray_lowering.reaper import start_reaper

        start_reaper()  # Ray's processes end with this one, however it ends (a SIGKILL included)
        session = RaySession(_local_gcs, namespace, True, True, local=True)
        for restore in undo:
            session.add_cleanup(restore)
        return session
    _probe_address(_resolve_address(address), address, connect_timeout_s)
    if not address.startswith("ray://"):
        _check_authentication(_resolve_address(address), address, connect_timeout_s)
    undo = _join_on_loopback(_resolve_address(address))
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, runtime_env={"env_vars": env})
    except (ConnectionError, RuntimeError, SystemExit) as error:  # Ray exits the process if GCS never answers
        for restore in reversed(undo):
            restore()
        raise ClusterError(f"could not join the Ray cluster at {address!r}: {error}. {_ADDRESS_HINT}") from None
    session = RaySession(address, namespace, False, True)
    for restore in undo:
        session.add_cleanup(restore)
    return session


def _join_on_loopback(host_port: str) -> list[Callable[[], None]]:
    """A cluster at a loopback address (another local run's Ray, or `ray start
    --node-ip-address 127.0.0.1`) serves on loopback only: this process joins
    on loopback too, as a local start does, or Ray looks for the cluster at
    the machine's routable address and retries there for minutes. Returns
    what undoes it (nothing for any other address)."""
    host = host_port.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return []
    return _on_loopback() if loopback else []


def _on_loopback(env: dict[str, str] | None = None) -> list[Callable[[], None]]:
    """This process (and the Ray workers it starts) on loopback, with ``env``
    beside; returns what undoes it, in the order to add as cleanups."""
    return [_set_environ({**(env or {}), **loopback_env()}), _ray_on_loopback()]


class _DefaultAuthNotice(logging.Filter):
    """Ray's notice, on every local start, that it chose its own default
    (token authentication): true of every run, so not repeated to the user.
    Its notice that authentication is *disabled* still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


_DEFAULT_AUTH_NOTICE = _DefaultAuthNotice()  # one instance: adding it again is a no-op


def _local_start_failure(error: Exception) -> str:
    """One line for a local Ray that did not start (Ray waits a fixed 30 s for its own processes)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    busy = (f"; the machine is busy (load {load:.1f} on {cores} cores), which can outlast Ray's own 30 s start wait"
            if load > cores else "")
    return (f"the local Ray did not start: {lines[0] if lines else type(error).__name__}{busy}. Run the same "
            "command again (nothing was started); if it keeps failing, `ray start --head` shows Ray's own error")


def _remember_local(gcs_address: str | None) -> None:
    global _local_gcs
    _local_gcs = gcs_address


@contextlib.contextmanager
def ray_session(
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int = 0,
    namespace: str = "rldsl",
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> Iterator[RaySession]:
    """``start_ray`` as a context manager: on success, error or Ctrl-C it runs
    the session's cleanups and stops the Ray it started (or disconnects)."""
    session = start_ray(address, num_cpus, num_gpus, namespace, connect_timeout_s)
    try:
        yield session
    finally:
        session.shutdown()


_ADDRESS_HINT = (
    "Check that `ray start --head` runs on that host, that the port is the GCS port "
    "(6379 by default; not the dashboard's 8265, and 10001 only with ray://), and that no "
    "firewall blocks it. Pass no address to start a local Ray instead."
)


def _resolve_address(address: str) -> str:
    """host:port to probe; "auto" is looked up the way Ray does (RAY_ADDRESS,
    then the cluster last started by `ray start` on this machine)."""
    if address != "auto":
        return address.removeprefix("ray://")
    from ray._private.services import (
        canonicalize_bootstrap_address,  # private; checked on Ray 2.60
    )

    try:
        resolved = canonicalize_bootstrap_address("auto")
    except ConnectionError:
        resolved = None
    if not resolved:
        raise ClusterError(
            "address='auto' found no running Ray cluster on this machine (RAY_ADDRESS is unset "
            "and no `ray start` cluster is recorded). Start one with `ray start --head` or pass no address."
        )
    return resolved


def _probe_address(host_port: str, address: str, timeout_s: float) -> None:
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"Ray address {address!r} is not host:port (e.g. 10.0.0.1:6379 or ray://10.0.0.1:10001)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as error:
        raise ClusterError(
            f"cannot reach the Ray cluster at {address!r} ({host}:{port}) within {timeout_s:g} s: {error}. "
            f"{_ADDRESS_HINT}"
        ) from None


def _check_authentication(host_port: str, address: str, timeout_s: float) -> None:
    """A cluster with token authentication refuses a client without its
    token; Ray itself then retries for a while and blames the network. Ask
    the GCS once, with the token Ray's own mechanisms find (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), and say what is wrong. The
    cluster's settings are never changed. Private Ray modules, checked on 2.60;
    without them the check is skipped and ray.init reports."""
    try:
        import grpc
        from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return
    headers = get_auth_headers_if_auth_enabled({})
    metadata = [(key.lower(), value) for key, value in headers.items()] or None
    with grpc.insecure_channel(host_port) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAUTHENTICATED:
                return  # not an authentication problem: ray.init says what it is
            if not headers:
                raise ClusterError(
                    f"the Ray cluster at {address!r} requires token authentication and no token was found here. "
                    "Give rldsl the cluster's token the way Ray takes it: RAY_AUTH_MODE=token with RAY_AUTH_TOKEN=..., "
                    "or RAY_AUTH_TOKEN_PATH=<file>, or the token in ~/.ray/auth_token") from None
            raise ClusterError(
                f"the Ray cluster at {address!r} refused the authentication token found here (RAY_AUTH_TOKEN, "
                "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token): use that cluster's token") from None


def has_cuda() -> bool:
    """Whether this process sees a CUDA GPU (False without torch)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
