"""Ray lowering helpers against a real local Ray (one per module) with two
logical GPUs, and TransferQueue written by an actor and read by the driver."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from rldsl.runtime.dataplane import connect_dataplane, sample_key  # noqa: E402
from rldsl.runtime.ray_lowering import cluster  # noqa: E402
from rldsl.runtime.ray_lowering.cluster import (  # noqa: E402
    ACTOR_NUM_CPUS,
    ClusterError,
    RaySession,
    logical_cpus_needed,
    ray_session,
)
from rldsl.runtime.ray_lowering.placement import create_placement_group  # noqa: E402
from tests.runs import ROOT, release_shared_ray  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.own_ray]


@pytest.fixture(scope="module")
def session():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    release_shared_ray()
    with ray_session(num_gpus=2, namespace="rldsl-test-cluster") as ray_cluster:
        yield ray_cluster


@pytest.fixture(scope="module")
def transferqueue(session):
    pytest.importorskip("transfer_queue")
    plane = connect_dataplane({"backend": "transferqueue", "storage_units": 1})
    session.add_cleanup(plane.close)
    return plane


def test_local_ray_has_logical_cpus_and_gpus(session):
    resources = ray.cluster_resources()
    assert session.started_here
    assert resources["GPU"] == 2
    assert resources["CPU"] >= logical_cpus_needed() >= 8


def test_placement_group_that_fits_is_created(session):
    from ray.util.placement_group import remove_placement_group

    group = create_placement_group([{"GPU": 1, "CPU": ACTOR_NUM_CPUS}] * 2, "PACK", "fits", timeout_s=20)
    try:
        assert ray.util.placement_group_table(group)["state"] == "CREATED"
    finally:
        remove_placement_group(group)


def test_placement_group_larger_than_the_cluster_fails_at_once(session):
    started = time.monotonic()
    with pytest.raises(ClusterError) as error:
        create_placement_group([{"GPU": 1}] * 3, "SPREAD", "too-big", timeout_s=30)
    assert time.monotonic() - started < 5
    assert "GPU=1 more than the whole cluster" in str(error.value)
    assert "cluster total" in str(error.value)


def test_placement_group_blocked_by_held_resources_times_out(session):
    from ray.util.placement_group import remove_placement_group

    holder = create_placement_group([{"GPU": 2}], "PACK", "holder", timeout_s=20)
    try:
        started = time.monotonic()
        with pytest.raises(ClusterError) as error:
            create_placement_group([{"GPU": 1, "CPU": 0.5}], "PACK", "blocked", timeout_s=1)
        assert time.monotonic() - started < 6
        message = str(error.value)
        assert "blocked" in message and "within 1 s" in message and "GPU=1" in message
        assert "CPU" not in message.splitlines()[0]  # CPUs are free: only the GPU is named missing
    finally:
        remove_placement_group(holder)


def test_unreachable_address_fails_fast_with_a_clear_message():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = textwrap.dedent(
        f"""
        from rldsl.runtime.ray_lowering.cluster import ClusterError, start_ray
        try:
            start_ray("127.0.0.1:{port}", connect_timeout_s=2)
        except ClusterError as error:
            print("CLUSTER_ERROR", error)
        """
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 20, result.stderr
    assert "CLUSTER_ERROR" in result.stdout, result.stderr
    assert f"127.0.0.1:{port}" in result.stdout and "ray start --head" in result.stdout


def test_a_local_ray_that_does_not_start_is_one_clear_error(monkeypatch):
    def timed_out(**_):
        raise Exception("The current node timed out during startup. This could happen because some of the "
                        "raylet failed to startup or the GCS has become overloaded.")

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", timed_out)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(os, "getloadavg", lambda: (18.5, 17.0, 12.0))
    with pytest.raises(ClusterError) as raised:
        cluster.start_ray(num_cpus=2)
    message = str(raised.value)
    assert message.startswith("the local Ray did not start: The current node timed out during startup.")
    assert "busy (load 18.5 on" in message and "Run the same command again" in message
    assert "\n" not in message and calls == ["shutdown"]  # one line; nothing half-started left


def test_ray_session_cleans_up_and_shuts_down_on_ctrl_c(monkeypatch):
    calls = []
    monkeypatch.setattr(cluster, "start_ray", lambda *args: RaySession("fake:1", "ns", True, True))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    with pytest.raises(KeyboardInterrupt):
        with ray_session() as fake:
            fake.add_cleanup(lambda: calls.append("first"))
            fake.add_cleanup(lambda: 1 / 0)  # a failing cleanup does not stop the rest
            fake.add_cleanup(lambda: calls.append("last"))
            raise KeyboardInterrupt
    assert calls == ["last", "first", "shutdown"]


def test_a_session_we_did_not_start_is_left_running(session):
    with ray_session() as reused:
        assert not reused.started_here
    assert ray.is_initialized()


def test_another_run_joins_a_local_ray_by_address_and_is_told_the_data_plane_is_taken(session, transferqueue,
                                                                                      tmp_path):
    """A local Ray serves on loopback only; `rldsl run --address` from a shell
    without the local start's settings joins it on loopback too (else Ray looks
    for it at the machine's routable address for minutes). TransferQueue there
    belongs to the run that started it (its storage units live in that run's
    namespace): this run is refused, named, before any actor starts."""
    shell = {name: value for name, value in os.environ.items() if name not in cluster.loopback_env()}
    joined = subprocess.run([sys.executable, "-m", "rldsl", "run", "pipelines/sim_async.rlp", "--address",
                             session.address, "--run-dir", str(tmp_path / "run")], env=shell, capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    assert joined.returncode == 2, joined.stderr[-3000:]
    assert "Connected to Ray cluster" in joined.stderr and "Traceback" not in joined.stderr
    assert ("already runs the TransferQueue data plane of another run (Ray namespace rldsl-test-cluster; this run's "
            "is rldsl-sim_async)") in joined.stderr, joined.stderr[-3000:]


@ray.remote(num_cpus=ACTOR_NUM_CPUS)
class Worker:
    """Attaches to the data plane from its own process, like an engine does."""

    def __init__(self, spec):
        started = time.perf_counter()
        self.plane = connect_dataplane(spec)
        self.attach_s = time.perf_counter() - started

    def write(self, keys, partition):
        rows = torch.arange(len(keys) * 3).view(len(keys), 3)
        self.plane.put(keys, partition, {"response_ids": rows, "reward": torch.ones(len(keys))})
        return self.attach_s


def test_an_actor_writes_fields_the_driver_reads(session, transferqueue):
    keys = [sample_key("cluster-test", 0, s) for s in range(4)]
    writer = Worker.remote(transferqueue.spec)
    attach_s = ray.get(writer.write.remote(keys, "rollout"), timeout=60)
    assert attach_s < 5, f"attaching to TransferQueue from an actor took {attach_s:.2f} s"
    batch = transferqueue.get(keys, "rollout", ["response_ids", "reward"])
    assert torch.equal(batch["response_ids"], torch.arange(12).view(4, 3))
    assert batch["reward"].tolist() == [1.0] * 4
    ray.kill(writer)


def test_a_worker_setup_hook_that_does_not_import_is_named(monkeypatch):
    from rldsl.runtime.ray_lowering.actor_process import WORKER_SETUP_ENV, setup_worker_process

    monkeypatch.setenv(WORKER_SETUP_ENV, "no_such_module:install")
    with pytest.raises(RuntimeError, match="RLDSL_WORKER_SETUP='no_such_module:install' names no importable"):
        setup_worker_process()


def test_a_process_group_that_cannot_form_names_the_group_and_the_missing_ranks(session, monkeypatch):
    from rldsl.runtime.ray_lowering.rendezvous import TIMEOUT_ENV, RendezvousTimeout, create_board, join_process_group

    monkeypatch.setenv(TIMEOUT_ENV, "1")
    board = create_board()  # noqa: F841  (held: the named actor lives with its handle)
    with pytest.raises(RendezvousTimeout, match=r"process group `p/actor` did not form within 1 s: rank\(s\) \[0\] of 2"):
        join_process_group("p/actor", rank=1, world_size=2)
    ray.kill(board)
