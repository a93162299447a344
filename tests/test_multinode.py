"""Plans on a real multi-node Ray: three raylets on this machine (a head
without GPUs and two nodes with three logical GPUs each), through
``ray.cluster_utils.Cluster``.

Each test checks, per actor, the Ray node and the GPU ids against the plan:
actors of one plan node share one Ray node, the two plan nodes are two
different GPU nodes, and every actor's devices are the plan's GPU ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from ray.cluster_utils import Cluster

from rldsl.compiler.driver import compile_source  # noqa: E402

from tests.runs import release_shared_ray  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.ray, pytest.mark.own_ray]

GPUS_PER_NODE = 3

SIM_TP2 = """
pipeline tp2
cluster { nodes = 2  gpus_per_node = 3 }
model policy { source = "builtin:tiny-lm" }
dataset prompts { source = "builtin:arith" }
stage generate rollout {
  model = policy  engine = sim(latency = 10ms, tp = 2)  gpus = [0, 1, 3, 4]  samples_per_prompt = 4
}
stage reward score { fn = "rldsl.rewards:exact_match" }
stage logprob reference { model = policy  frozen  engine = sim(latency = 2ms)  colocate = actor }
stage train actor {
  model = policy  engine = sim(latency = 10ms)  gpus = [2, 5]  prompts_per_step = 4  micro_batch = 4
}
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> reference -> actor
staleness { max_lag = 1 }
run { steps = 3  watchdog = 60s }
"""


@pytest.fixture(scope="module")
def cluster():
    yield from gpu_cluster()


def gpu_cluster():
    """A head without GPUs and two nodes of GPUS_PER_NODE logical GPUs; yields
    (the cluster, the GPU nodes' ids), shut down after."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    release_shared_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 0})
    gpu_nodes = [cluster.add_node(num_cpus=6, num_gpus=GPUS_PER_NODE) for _ in range(2)]
    cluster.wait_for_nodes()
    yield cluster, {node.node_id for node in gpu_nodes}
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.rlp"
    path.write_text(text)
    return path


def rldsl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "rldsl", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env, check=False)


def assert_matches_plan(placement: dict, plan: dict, gpu_nodes: set[str]) -> None:
    """Per actor: its Ray node is the one of its plan node, its devices are the plan's GPU ids."""
    ranks = {f"{stage['name']}-{rank['index']}": rank for pipe in plan["pipelines"] for stage in pipe["stages"]
             for rank in stage["ranks"] if rank["gpus"]}
    assert set(placement["actors"]) == set(ranks)
    ray_node_of_plan_node: dict[int, str] = {}
    for name, actor in placement["actors"].items():
        rank = ranks[name]
        assert actor["gpu_ids"] == rank["gpus"], name
        assert actor["cuda_visible_devices"] == ",".join(map(str, rank["gpus"])), name
        assert ray_node_of_plan_node.setdefault(rank["node"], actor["node_id"]) == actor["node_id"], name
    assert len(set(ray_node_of_plan_node.values())) == len(ray_node_of_plan_node) == 2
    assert set(ray_node_of_plan_node.values()) <= gpu_nodes


def run_on(cluster, tmp_path: Path, text: str) -> tuple[dict, dict]:
    """`rldsl run --address` onto the cluster; checks every actor against the
    plan; returns (the plan, the summary)."""
    ray_cluster, gpu_nodes = cluster
    proc = rldsl("run", str(write(tmp_path, text)), "--address", ray_cluster.address,
                 "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert_matches_plan(json.loads((run_dir / "placement.json").read_text()), plan, gpu_nodes)
    return plan, json.loads((run_dir / "summary.json").read_text())


def stage_ranks(plan: dict, name: str) -> list[dict]:
    return next(s for s in plan["pipelines"][0]["stages"] if s["name"] == name)["ranks"]


def test_sim_tp2_replicas_and_a_trainer_across_two_nodes(cluster, tmp_path):
    plan, summary = run_on(cluster, tmp_path, SIM_TP2)
    # one actor per replica
    assert [(r["node"], r["gpus"]) for r in stage_ranks(plan, "rollout")] == [(0, [0, 1]), (1, [0, 1])]
    assert summary["steps"] == 3 and summary["ledger"]["trained"] == 3 * 4 * 4


def test_dry_run_reports_where_every_actor_would_start_and_exits(cluster, tmp_path):
    ray_cluster, _ = cluster
    proc = rldsl("run", str(write(tmp_path, SIM_TP2)), "--address", ray_cluster.address, "--dry-run",
                 "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # nothing but a report
    for actor, devices in (("rollout-0", "0,1"), ("rollout-1", "0,1"), ("actor-0", "2"), ("actor-1", "2"),
                           ("reference-1", "2")):
        line = next(line for line in proc.stdout.splitlines() if line.startswith(actor + " "))
        assert line.split()[-1] == devices, line
    assert "placement matches the plan" in proc.stdout


def test_dry_run_says_per_node_what_is_missing(cluster, tmp_path):
    ray_cluster, _ = cluster
    text = (SIM_TP2.replace("gpus_per_node = 3", "gpus_per_node = 4").replace("[0, 1, 3, 4]", "[0, 1, 4, 5]")
            .replace("[2, 5]", "[2, 3, 6, 7]"))
    proc = rldsl("run", str(write(tmp_path, text)), "--address", ray_cluster.address, "--dry-run")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "plan node 0" in proc.stderr and "plan node 1" in proc.stderr
    assert "GPU=4" in proc.stderr and "lacks GPU=1" in proc.stderr
    assert "Traceback" not in proc.stderr


TORCH_DP2 = """
pipeline torch_dp2
cluster { nodes = 2  gpus_per_node = 3 }
model policy { source = "builtin:tiny-lm" }
dataset prompts { source = "builtin:arith"  eval_size = 0 }
stage generate rollout { model = policy  gpus = [0]  samples_per_prompt = 4  max_new_tokens = 6 }
stage reward score { fn = "rldsl.rewards:exact_match" }
stage train actor {
  model = policy  gpus = [1, 4]  prompts_per_step = 4  micro_batch = 4
  loss = grpo(clip = 0.2, kl = 0.0, agg = token_mean)
}
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> actor
staleness { max_lag = 1 }
run { steps = 2  watchdog = 120s }
"""


def test_torch_trainer_dp2_over_two_nodes_forms_its_group_and_trains(cluster, tmp_path):
    plan, summary = run_on(cluster, tmp_path, TORCH_DP2)
    assert [r["node"] for r in stage_ranks(plan, "actor")] == [0, 1]
    assert summary["steps"] == 2 and summary["version"] == 2


def test_split_step_gradient_over_two_nodes_equals_the_full_batch(cluster):
    """The cross-node gloo group of the real rendezvous carries the split step:
    the averaged gradient equals one full-batch backward."""
    from rldsl.layout import ActorSlot, layout_bundles
    from rldsl.runtime.ray_lowering.cluster import ray_session
    from rldsl.runtime.ray_lowering.placement import reserve
    from rldsl.runtime.ray_lowering.rendezvous import create_board
    from tests.test_split_step_gradient import LOSS_CONFIGS, full_batch_gradients, make_batch, make_model

    ray_cluster, gpu_nodes = cluster
    slots = [ActorSlot(f"rank-{r}", "actor", r, r, (0,), 1.0) for r in range(2)]
    with ray_session(ray_cluster.address, namespace="rldsl-test-split-step"):
        reservation = reserve(layout_bundles(slots, 0.25), GPUS_PER_NODE, fold=False, name="split-step")
        board = create_board()  # noqa: F841  (held: the named actor lives with its handle)
        workers = [ray.remote(SplitStepRank).options(**reservation.actor_options(s)).remote() for s in slots]
        rows = [(0, 3), (3, 7)], [(7, 10)]  # uneven rows per rank, one microbatch count each side
        results = ray.get([w.gradients.remote(r, 2, rows[r]) for r, w in enumerate(workers)])
        reservation.release()
    nodes = {node for node, _ in results}
    assert len(nodes) == 2 and nodes <= gpu_nodes
    model, config = make_model(), LOSS_CONFIGS[0]
    expected = full_batch_gradients(model, make_batch(model), config)
    for _, grads in results:
        scale = max(float(g.abs().max()) for g in expected)
        assert max(float((a - e).abs().max()) for a, e in zip(grads, expected)) / scale < 1e-5


class SplitStepRank:
    def gradients(self, rank: int, world_size: int, row_splits: list[tuple[int, int]]):
        import ray

        from rldsl.runtime.engines.torch.train import TorchTrainer
        from rldsl.runtime.ray_lowering.rendezvous import join_process_group
        from tests.test_split_step_gradient import LOSS_CONFIGS, make_batch, make_model

        group = join_process_group("split-step/actor", rank, world_size)
        model = make_model()
        batch = make_batch(model)
        trainer = TorchTrainer(model, loss=LOSS_CONFIGS[0], lr=0.0, max_grad_norm=None, process_group=group)
        trainer.begin_train_step(0)
        for start, stop in row_splits:
            trainer.train_microbatch(0, {k: v[start:stop] for k, v in batch.items()})
        trainer.finish_train_step(0)
        return ray.get_runtime_context().get_node_id(), [p.grad.clone() for p in trainer.parameters]


# ---------------------------------------------- a vLLM replica across nodes
# tp = 1, pp = 2 reserved on the two GPU nodes: its own placement group with a
# 1-GPU bundle on each planned node and a CPU bundle for its actor, which
# finds that group as vLLM's Ray executor would. No vLLM here: its engine
# never starts, only the placement is checked.

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


@contextlib.contextmanager
def reserved(cluster, text: str):
    """The plan of ``text`` reserved on the cluster (not folded), released after."""
    from rldsl.layout import actor_slots, layout_bundles
    from rldsl.runtime.ray_lowering.cluster import ray_session
    from rldsl.runtime.ray_lowering.placement import reserve

    result = compile_source(text)
    assert result.ok, [d.message for d in result.diagnostics]
    layout = layout_bundles(actor_slots(result.plan), 0.25)
    name = result.plan.pipelines[0].name
    with ray_session(cluster[0].address, namespace=f"rldsl-test-{name}"):
        reservation = reserve(layout, GPUS_PER_NODE, fold=False, name=name, timeout_s=30)
        try:
            yield reservation
        finally:
            reservation.release()


class Replica:
    """Stands in for the vLLM generator actor: what its engine would see."""

    def group_and_workers(self):
        from rldsl.runtime.ray_lowering.placement_check import probe_gpu_bundles

        group = ray.util.get_current_placement_group()  # what vLLM reads in a Ray actor
        return group.id.hex(), ray.get_runtime_context().get_node_id(), ray.get_gpu_ids(), probe_gpu_bundles()


def test_the_replica_gets_a_group_across_both_nodes_and_its_workers_land_on_the_planned_gpus(cluster):
    from ray.util import placement_group_table

    _, gpu_nodes = cluster
    assert GPUS_PER_NODE == 3
    with reserved(cluster, PP2) as reservation:
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


COLOCATED_TP2 = """
pipeline tp2c
cluster { nodes = 2  gpus_per_node = 3 }
model policy { source = "builtin:tiny-gpt2" }
dataset prompts { source = "builtin:arith" }
stage generate rollout { model = policy  engine = vllm(tp = 2)  colocate = actor  samples_per_prompt = 4 }
stage reward score { fn = "rldsl.rewards:exact_match" }
stage train actor { model = policy  engine = sim  gpus = [3, 4]  prompts_per_step = 4  micro_batch = 2 }
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> actor
staleness { max_lag = 1 }
"""


def test_a_tp2_replica_on_its_trainers_gpus_leaves_them_to_workers_beside_the_trainers_ranks(cluster, tmp_path):
    """verl's colocated tp-2 rollout, through the launcher's dry run: the trainer's ranks take half of each GPU,
    the replica's actor none, and a probe where vLLM's Ray executor puts each worker (the bundle and the half its
    variables name) lands on the device of the rank of its GPU."""
    lines, replica, workers = dry_run_of_replica(cluster, tmp_path, COLOCATED_TP2)
    assert replica.split()[1] == "1:0,1"
    ranks = {actor: next(line for line in lines if line.startswith(actor + " ")).split()[-1]
             for actor in ("actor-0", "actor-1")}
    assert [(w[2], w[-1]) for w in workers] == [("1:0", ranks["actor-0"]), ("1:1", ranks["actor-1"])]


def dry_run_of_replica(cluster, tmp_path: Path, text: str) -> tuple[list[str], str, list[list[str]]]:
    """`rldsl run --dry-run` of ``text`` on the cluster, its placement matching the plan: its output's lines,
    `rollout-0`'s (its engine's workers hold its GPUs) and its workers' (split)."""
    proc = rldsl("run", str(write(tmp_path, text)), "--address", cluster[0].address, "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "placement matches the plan" in proc.stdout and "note:" not in proc.stdout
    lines = proc.stdout.splitlines()
    replica = next(line for line in lines if line.startswith("rollout-0 "))
    assert replica.endswith("(its workers')")
    return lines, replica, [line.split() for line in lines if line.startswith("  worker ")]


def test_dry_run_reports_the_replica_and_where_each_of_its_gpu_bundles_lands(cluster, tmp_path):
    lines, replica, workers = dry_run_of_replica(cluster, tmp_path, PP2)
    assert replica.split()[1] == "0:0+1:0"
    assert [(w[2], w[-1]) for w in workers] == [("0:0", "0"), ("1:0", "0")]
    for actor, devices in (("actor-0", "1"), ("actor-1", "2"), ("actor-2", "1"), ("reference-3", "2")):
        assert next(line for line in lines if line.startswith(actor + " ")).split()[-1] == devices


def test_a_replica_across_nodes_sharing_its_gpus_is_refused_before_ray_starts(tmp_path):
    """By `check` itself (RLP512): the launcher's layout runs on every plan that checks."""
    text = PP2.replace("colocate = actor", "colocate = rollout")
    proc = rldsl("run", str(write(tmp_path, text)), "--dry-run")
    assert proc.returncode == 1 and "error[RLP512]" in proc.stderr, proc.stderr[-3000:]
    assert "`rollout-0` spans nodes and shares GPU(s) 0:0 with reference-0" in proc.stderr
    assert "a replica across nodes needs its GPUs to itself" in proc.stderr and "Traceback" not in proc.stderr
