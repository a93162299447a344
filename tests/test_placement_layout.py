"""Bundles shaped like actors, plan nodes matched to Ray nodes, and the
placement check, as pure functions (no Ray)."""

from __future__ import annotations

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.layout import ActorSlot, LayoutError, actor_slots, layout_bundles
from rldsl.runtime.ray_lowering.cluster import ClusterError
from rldsl.runtime.ray_lowering.placement import RayNode, Reservation, assign_nodes
from rldsl.runtime.ray_lowering.placement_check import check_placement

VLLM_TP2 = """
pipeline p
cluster { nodes = 1  gpus_per_node = 8 }
model policy { source = "builtin:tiny-lm" }
dataset prompts { source = "builtin:arith" }
stage generate rollout { model = policy  engine = sim(tp = 2)  gpus = [0, 1, 2, 3]  samples_per_prompt = 4 }
stage reward score { fn = "rldsl.rewards:exact_match" }
stage logprob reference { model = policy  frozen  engine = sim  colocate = actor }
stage train actor { model = policy  engine = sim  gpus = [4, 5]  prompts_per_step = 4  micro_batch = 4 }
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> reference -> actor
"""


def plan_of(text: str):
    result = compile_source(text)
    assert result.ok, [d.message for d in result.diagnostics]
    return result.plan


def test_a_tp2_replica_gets_one_two_gpu_bundle_and_colocated_ranks_share_one_gpu():
    layout = layout_bundles(actor_slots(plan_of(VLLM_TP2)), actor_cpus=0.25)
    bundles = layout.nodes[0]
    assert [(b.gpus, sorted(s.name for s in b.residents)) for b in bundles] == [
        ((0, 1), ["rollout-0"]), ((2, 3), ["rollout-1"]),
        ((4,), ["actor-0", "reference-0"]), ((5,), ["actor-1", "reference-1"])]
    assert [b.resources(0.25) for b in bundles] == [{"GPU": 2.0, "CPU": 0.25}, {"GPU": 2.0, "CPU": 0.25},
                                                    {"GPU": 1.0, "CPU": 0.5}, {"GPU": 1.0, "CPU": 0.5}]
    assert layout.num_gpus(layout.slot("rollout-1")) == 2.0  # whole GPUs, never more than its bundle holds
    assert layout.num_gpus(layout.slot("reference-0")) == 0.5
    assert layout.node_needs() == {0: {"GPU": 6.0, "CPU": 1.5}}


def test_a_multi_gpu_actor_that_shares_its_gpus_is_refused_with_the_reason():
    slots = [ActorSlot("rollout-0", "rollout", 0, 0, (0, 1), 0.5), ActorSlot("actor-0", "actor", 0, 0, (0,), 0.5),
             ActorSlot("actor-1", "actor", 1, 0, (1,), 0.5)]
    with pytest.raises(LayoutError, match=r"`rollout-0` drives GPUs 0, 1 of node 0 as one actor and shares them "
                                          r"with actor-0, actor-1: Ray gives an actor either whole GPUs"):
        layout_bundles(slots, 0.25)


def node(node_id: str, gpus: float, cpus: float = 8.0) -> RayNode:
    return RayNode(node_id * 8, f"10.0.0.{len(node_id)}", {"GPU": gpus, "CPU": cpus})


def test_plan_nodes_get_distinct_ray_nodes_that_fit():
    needs = {0: {"GPU": 4.0, "CPU": 1.0}, 1: {"GPU": 2.0, "CPU": 1.0}}
    nodes = [node("a", 2), node("b", 4), node("c", 0)]
    assigned = assign_nodes(needs, nodes, fold=False)
    assert (assigned[0].node_id[0], assigned[1].node_id[0]) == ("b", "a")


def test_a_plan_that_cannot_get_its_nodes_says_per_plan_node_what_is_missing():
    needs = {0: {"GPU": 4.0, "CPU": 1.0}, 1: {"GPU": 4.0, "CPU": 1.0}}
    with pytest.raises(ClusterError) as error:
        assign_nodes(needs, [node("a", 4), node("b", 3)], fold=False)
    text = str(error.value)
    assert "plan node 0 (CPU=1, GPU=4)" in text and "plan node 1 (CPU=1, GPU=4)" in text
    assert "the nodes that fit (10.0.0.1 (aaaaaaaa)) are taken by other plan nodes" in text


def test_a_local_run_folds_every_plan_node_onto_its_one_node():
    assigned = assign_nodes({0: {"GPU": 2.0}, 1: {"GPU": 2.0}}, [node("a", 4)], fold=True)
    assert {n.node_id[0] for n in assigned.values()} == {"a"}
    with pytest.raises(ClusterError, match="lacks GPU=1"):
        assign_nodes({0: {"GPU": 2.0}, 1: {"GPU": 3.0}}, [node("a", 4)], fold=True)


def reservation_for(slots, folded=False) -> Reservation:
    layout = layout_bundles(slots, 0.25)
    nodes = {n: node(chr(ord("a") + n), 8) for n in layout.node_needs()}
    return Reservation(layout, nodes, {}, folded, gpus_per_node=8)


def report(node_id: str, devices: list[int]) -> dict:
    return {"node_id": node_id * 8, "node_ip": "10.0.0.1", "gpu_ids": devices,
            "cuda_visible_devices": ",".join(map(str, devices))}


def test_the_placement_check_accepts_the_plan_and_names_what_differs():
    slots = [ActorSlot("gen-0", "gen", 0, 0, (0, 1), 1.0), ActorSlot("act-0", "act", 0, 1, (0,), 0.5),
             ActorSlot("ref-0", "ref", 0, 1, (0,), 0.5)]
    reservation = reservation_for(slots)
    good = {"gen-0": report("a", [0, 1]), "act-0": report("b", [0]), "ref-0": report("b", [0])}
    result = check_placement(reservation, good, slots)
    assert (result.errors, result.notes) == ([], [])
    shifted = {**good, "act-0": report("b", [3]), "ref-0": report("b", [3])}
    result = check_placement(reservation, shifted, slots)
    assert result.errors == [] and "plan GPU(s) 1:0 are device(s) 3" in result.notes[0]
    wrong = {**good, "act-0": report("a", [2]), "ref-0": report("b", [1])}
    errors = check_placement(reservation, wrong, slots).errors
    assert any("`act-0` runs on Ray node aaaaaaaa" in e for e in errors)
    assert any("plan GPU 1:0 is device 2 for one actor and 1 for `ref-0`" in e for e in errors)


def test_gpus_below_the_highest_used_get_filler_bundles_so_device_numbers_match_the_plan():
    slots = [ActorSlot("actor-1", "actor", 1, 0, (2,), 1.0)]
    layout = layout_bundles(slots, 0.25)
    assert [(b.gpus, b.resources(0.25)) for b in layout.nodes[0]] == [
        ((0,), {"GPU": 1.0}), ((1,), {"GPU": 1.0}), ((2,), {"GPU": 1.0, "CPU": 0.25})]
    assert layout.bundle_of(slots[0]).index == 2 and sum(not b.residents for b in layout.nodes[0]) == 2
    folded = layout_bundles(slots, 0.25, gpus_per_node=4)  # a local Ray holds every GPU of the plan node
    assert [b.gpus for b in folded.nodes[0]] == [(0,), (1,), (2,), (3,)]


def test_a_replica_across_nodes_is_checked_by_its_probes_of_the_gpu_bundles():
    slots = [ActorSlot("gen-0", "gen", 0, 0, (0,), 1.0, ((1, (0,)),)), ActorSlot("act-0", "act", 0, 1, (1,), 1.0)]
    reservation = reservation_for(slots)
    probed = {**report("a", []), "engine_workers": [report("a", [0]), report("b", [0])]}
    good = {"gen-0": probed, "act-0": report("b", [1])}
    result = check_placement(reservation, good, slots)
    assert (result.errors, result.notes) == ([], [])
    rows = result.table(reservation).splitlines()
    assert rows[1].split()[:2] == ["gen-0", "0:0+1:0"] and rows[1].endswith("(its workers')")
    assert [row.split()[:4] for row in rows[2:4]] == [["worker", "0", "0:0", "10.0.0.1"],
                                                      ["worker", "1", "1:0", "10.0.0.1"]]
    swapped = {**probed, "engine_workers": [report("b", [0]), report("a", [0])]}
    errors = check_placement(reservation, {**good, "gen-0": swapped}, slots).errors
    assert any("`gen-0 worker 1` runs on Ray node aaaaaaaa" in e and "plan node 1" in e for e in errors)
    holding = {**good, "gen-0": {**probed, "gpu_ids": [0]}}
    assert any("its engine's workers take its GPUs" in e for e in check_placement(reservation, holding,
                                                                                       slots).errors)
    clash = {**good, "act-0": report("b", [0])}  # the trainer rank on the replica's device of node b
    assert any("device 0 of" in e for e in check_placement(reservation, clash, slots).errors)
    in_a_run = check_placement(reservation, {**good, "gen-0": report("a", [])}, slots)
    assert in_a_run.errors == [] and "its engine's Ray workers hold its 2 GPU bundle(s)" in in_a_run.notes[0]


def test_a_vllm_replica_on_shared_gpus_is_checked_by_its_probes_beside_the_ranks_there():
    """Its workers (one per GPU, in the node's bundles) must each see the device the trainer rank on that GPU sees."""
    slots = [ActorSlot("gen-0", "gen", 0, 0, (0, 1), 0.5, engine="vllm"),
             ActorSlot("act-0", "act", 0, 0, (0,), 0.5), ActorSlot("act-1", "act", 1, 0, (1,), 0.5)]
    reservation = reservation_for(slots)
    probed = {**report("a", []), "engine_workers": [report("a", [0]), report("a", [1])]}
    good = {"gen-0": probed, "act-0": report("a", [0]), "act-1": report("a", [1])}
    result = check_placement(reservation, good, slots)
    assert (result.errors, result.notes) == ([], [])
    assert [row.split()[:3] for row in result.table(reservation).splitlines()[2:4]] == [["worker", "0", "0:0"],
                                                                                      ["worker", "1", "0:1"]]
    crossed = {**probed, "engine_workers": [report("a", [1]), report("a", [0])]}  # each beside the other rank
    errors = check_placement(reservation, {**good, "gen-0": crossed}, slots).errors
    assert "plan GPU 0:0 is device 1 for one actor and 0 for `act-0`" in errors, errors
