"""A vLLM replica across nodes (tp = 1, pp = 2) reserved on simulated Ray
nodes (``ray.cluster_utils.Cluster``, the fixture of test_multinode.py):
its own placement group with a 1-GPU bundle on each planned node and a CPU
bundle for its actor, which finds that group as vLLM's Ray executor would.
No vLLM here: its engine never starts, only the placement is checked."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from rldsl.compiler.driver import compile_source  # noqa: E402
from tests.test_multinode import GPUS_PER_NODE, gpu_cluster, rldsl, write  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.own_ray]


@pytest.fixture(scope="module")
def cluster():
    yield from gpu_cluster()

PP2 = """
pipeline pp2
cluster { nodes = 2  gpus_per_node = 3 }
model policy { source = "builtin:tiny-gpt2" }
dataset prompts { source = "builtin:arith" }
stage generate rollout { model = policy  engine = vllm(tp = 1, pp = 2)  gpus = [0, 3]  samples_per_prompt = 4 }
stage reward score { fn = "rldsl.rewards:exact_match" }
stage logprob reference { model = policy  frozen  engine = sim  colocate = actor }
stage train actor { model = policy  engine = sim  gpus = [1, 2, 4, 5]  prompts_per_step = 4  micro_batch = 2 }
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> reference -> actor
staleness { max_lag = 1 }
"""


class Replica:
    """Stands in for the vLLM generator actor: what its engine would see."""

    def group_and_workers(self):
        from rldsl.runtime.ray_lowering.placement_check import probe_gpu_bundles

        group = ray.util.get_current_placement_group()  # what vLLM reads in a Ray actor
        return group.id.hex(), ray.get_runtime_context().get_node_id(), ray.get_gpu_ids(), probe_gpu_bundles()


def test_the_replica_gets_a_group_across_both_nodes_and_its_workers_land_on_the_planned_gpus(cluster):
    from ray.util import placement_group_table

    from rldsl.layout import actor_slots, layout_bundles
    from rldsl.runtime.ray_lowering.cluster import ray_session
    from rldsl.runtime.ray_lowering.placement import reserve

    ray_cluster, gpu_nodes = cluster
    assert GPUS_PER_NODE == 3
    result = compile_source(PP2)
    assert result.ok, [d.message for d in result.diagnostics]
    layout = layout_bundles(actor_slots(result.plan), 0.25)
    with ray_session(ray_cluster.address, namespace="rldsl-test-cross-node"):
        reservation = reserve(layout, GPUS_PER_NODE, fold=False, name="pp2", timeout_s=30)
        try:
            group = reservation.spanning_groups["rollout-0"]
            ray_node = {plan: node.node_id for plan, node in reservation.nodes.items()}
            assert set(ray_node.values()) <= gpu_nodes and len(set(ray_node.values())) == 2
            table = placement_group_table(group)
            assert table["strategy"] == "PACK" and table["state"] == "CREATED"
            assert table["bundles"] == {0: {"GPU": 1.0}, 1: {"GPU": 1.0}, 2: {"CPU": 0.25}}
            assert table["bundles_to_node_id"] == {0: ray_node[0], 1: ray_node[1], 2: ray_node[0]}
            slot = reservation.slot("rollout-0")
            replica = ray.remote(Replica).options(**reservation.actor_options(slot)).remote()
            group_id, node_id, gpu_ids, workers = ray.get(replica.group_and_workers.remote(), timeout=120)
            assert (group_id, node_id, gpu_ids) == (group.id.hex(), ray_node[0], [])
            assert [(w["node_id"], w["gpu_ids"]) for w in workers] == [(ray_node[0], [0]), (ray_node[1], [0])]
            trainers = [placement_group_table(reservation.groups[n])["bundles"] for n in (0, 1)]
            assert trainers == [{0: {"GPU": 1.0, "CPU": 0.5}, 1: {"GPU": 1.0, "CPU": 0.5}}] * 2  # not GPU 0
            ray.kill(replica)
        finally:
            reservation.release()


def test_dry_run_reports_the_replica_and_where_each_of_its_gpu_bundles_lands(cluster, tmp_path):
    ray_cluster, _ = cluster
    proc = rldsl("run", str(write(tmp_path, PP2)), "--address", ray_cluster.address, "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    replica = next(line for line in lines if line.startswith("rollout-0 "))
    assert replica.split()[1] == "0:0+1:0" and replica.endswith("(its workers')")
    workers = [line.split() for line in lines if line.startswith("  worker ")]
    assert [(w[2], w[-1]) for w in workers] == [("0:0", "0"), ("1:0", "0")]
    for actor, devices in (("actor-0", "1"), ("actor-1", "2"), ("actor-2", "1"), ("reference-3", "2")):
        assert next(line for line in lines if line.startswith(actor + " ")).split()[-1] == devices
    assert "placement matches the plan" in proc.stdout and "note:" not in proc.stdout


def test_a_replica_across_nodes_sharing_its_gpus_is_refused_before_ray_starts(tmp_path):
    """By `check` itself (RLP512): the launcher's layout runs on every plan that checks."""
    text = PP2.replace("colocate = actor", "colocate = rollout")
    proc = rldsl("run", str(write(tmp_path, text)), "--dry-run")
    assert proc.returncode == 1 and "error[RLP512]" in proc.stderr, proc.stderr[-3000:]
    assert "`rollout-0` spans nodes and shares GPU(s) 0:0 with reference-0" in proc.stderr
    assert "a replica across nodes needs its GPUs to itself" in proc.stderr and "Traceback" not in proc.stderr
