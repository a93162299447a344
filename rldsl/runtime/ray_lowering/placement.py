"""Placement groups: reserve a plan's GPUs on a Ray cluster, or say why not.

Each plan node becomes one STRICT_PACK placement group whose bundles are
shaped like its actors (rldsl/layout.py), pinned to one Ray node chosen up front
(the ``ray.io/node-id`` label), so two plan nodes never land on one Ray node
and a plan that cannot fit is refused before anything starts, per node.
A replica across nodes (bundles.SpanningGroup) gets one PACK group of its
own whose bundles are each pinned to the Ray node of their plan node, the
same Ray nodes the per-node groups are pinned to. A local run folds every
plan node onto the one local Ray node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from rldsl.layout import ActorSlot, BundleLayout
from rldsl.runtime.ray_lowering.cluster import ClusterError

NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it (Ray >= 2.4x)


@dataclass(frozen=True)
class RayNode:
    node_id: str
    address: str
    resources: dict[str, float]  # totals

    @property
    def label(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


def alive_nodes() -> list[RayNode]:
    import ray

    nodes = [RayNode(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"])) for n in _alive_nodes(ray)]
    return sorted(nodes, key=lambda n: (n.address, n.node_id))


def assign_nodes(needs: dict[int, dict[str, float]], nodes: list[RayNode], fold: bool) -> dict[int, RayNode]:
    """Plan node -> a distinct Ray node that can hold its placement group
    (``fold``: every plan node on the one local node). Raises ClusterError
    saying, per plan node, what no free Ray node has."""
    if fold:
        total = _total(needs.values())
        missing = _shortfall(total, nodes[0].resources) if len(nodes) == 1 else {}
        if len(nodes) != 1 or missing:
            raise ClusterError(f"the local Ray lacks {_format(missing)} for the plan's {_format(total)}")
        return {plan_node: nodes[0] for plan_node in needs}
    graph = nx.Graph()
    for plan_node, need in needs.items():
        graph.add_node(("plan", plan_node))
        for node in nodes:
            if not _shortfall(need, node.resources):
                graph.add_edge(("plan", plan_node), ("ray", node.node_id))
    matching = nx.bipartite.maximum_matching(graph, top_nodes=[("plan", n) for n in needs]) if graph.edges else {}
    by_id = {n.node_id: n for n in nodes}
    assigned = {plan_node: by_id[matching[("plan", plan_node)][1]] for plan_node in needs
                if ("plan", plan_node) in matching}
    if len(assigned) == len(needs):
        return dict(sorted(assigned.items()))
    lines = [f"the plan needs {len(needs)} node(s), and Ray cannot give each its own node:"]
    for plan_node, need in sorted(needs.items()):
        fits = [n.label for n in nodes if not _shortfall(need, n.resources)]
        if plan_node in assigned:
            lines.append(f"  plan node {plan_node} ({_format(need)}): on {assigned[plan_node].label}")
        elif fits:
            lines.append(f"  plan node {plan_node} ({_format(need)}): the nodes that fit ({', '.join(fits)}) "
                         "are taken by other plan nodes")
        else:
            best = min(nodes, key=lambda n: sum(_shortfall(need, n.resources).values()), default=None)
            lines.append(f"  plan node {plan_node} ({_format(need)}): no Ray node has it"
                         + (f"; the closest, {best.label}, lacks {_format(_shortfall(need, best.resources))}"
                            if best else ""))
    raise ClusterError("\n".join(lines))


@dataclass
class Reservation:
    """The plan's placement groups on Ray: where each GPU actor goes."""

    layout: BundleLayout
    nodes: dict[int, RayNode]  # plan node -> Ray node
    groups: dict[int, object]  # plan node -> placement group
    folded: bool
    gpus_per_node: int
    store_dir: str | None = None  # where process groups meet when every rank is on this machine
    spanning_groups: dict[str, object] = field(default_factory=dict)  # replica across nodes -> its group

    def slot(self, name: str) -> ActorSlot:
        return self.layout.slot(name)

    def actor_options(self, slot: ActorSlot) -> dict:
        """A replica whose engine's Ray workers hold its GPUs captures its
        children in its group, so that vLLM's Ray executor finds the group
        (``get_current_placement_group``): across nodes it runs in the CPU
        bundle of a group of its own and a worker goes in each GPU bundle; on
        shared GPUs it runs in the bundle of its first GPU and vLLM's
        ``VLLM_RAY_BUNDLE_INDICES`` and ``VLLM_RAY_PER_WORKER_GPUS`` give each
        worker the bundle of its GPU and the replica's share of it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.layout.bundle_of(slot)
        spans = slot.name in self.spanning_groups
        workers = slot.name in self.layout.workers
        group = self.spanning_groups[slot.name] if spans else self.groups[slot.node]
        options = {"num_cpus": self.layout.actor_cpus, "num_gpus": self.layout.num_gpus(slot),
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(
                       group, bundle.index, placement_group_capture_child_tasks=True if spans or workers else None)}
        if workers:
            from rldsl.runtime.ray_lowering.actor_process import worker_setup_env

            options["runtime_env"] = {"env_vars": {**worker_setup_env(), **engine_worker_env(self.layout, slot)}}
        return options

    def expected_devices(self, slot: ActorSlot) -> tuple[int, ...]:
        """The device ids the plan means: its own on a real node; offset by
        the node when plan nodes are folded onto one local Ray node."""
        return tuple(self.expected_device(slot.node, gpu) for gpu in slot.gpus)

    def expected_device(self, node: int, gpu: int) -> int:
        return node * self.gpus_per_node + gpu if self.folded else gpu

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in [*self.groups.values(), *self.spanning_groups.values()]:
            remove_placement_group(group)


def engine_worker_env(layout: BundleLayout, slot: ActorSlot) -> dict[str, str]:
    """What tells vLLM's Ray executor where its workers go: their bundles and each one's share of its GPU."""
    return {"VLLM_RAY_BUNDLE_INDICES": ",".join(str(b.index) for b in layout.worker_bundles(slot)),
            "VLLM_RAY_PER_WORKER_GPUS": f"{layout.worker_gpus(slot):g}"}


def reserve(layout: BundleLayout, gpus_per_node: int, fold: bool, name: str, timeout_s: float = 60.0) -> Reservation:
    """One pinned STRICT_PACK group per plan node and one group per replica
    across nodes, created and waited for. Ray numbers each node's devices in
    the order groups are placed, so groups are created in the order of the
    GPUs they start at (plan node, then GPU): the plan's device ids on free
    nodes unless a replica's GPUs and another group's interleave on a node,
    or plan nodes are folded (the placement check notes the difference)."""
    nodes = assign_nodes(layout.node_needs(), alive_nodes(), fold)
    reservation = Reservation(layout, nodes, {}, fold, gpus_per_node)
    try:
        for _, kind, key in sorted(_creation_order(layout)):
            if kind == "node":
                bundles = layout.nodes[key]
                reservation.groups[key] = create_placement_group(
                    [b.resources(layout.actor_cpus) for b in bundles], "STRICT_PACK", name=f"{name}-node{key}",
                    timeout_s=timeout_s, node_id=nodes[key].node_id)
            else:
                bundles = layout.spanning[key].bundles
                reservation.spanning_groups[key] = create_placement_group(
                    [b.resources(layout.actor_cpus) for b in bundles], "PACK", name=f"{name}-{key}",
                    timeout_s=timeout_s, bundle_node_ids=[nodes[b.node].node_id for b in bundles])
    except ClusterError:
        reservation.release()  # what was placed so far would otherwise stay reserved
        raise
    return reservation


def _creation_order(layout: BundleLayout) -> list[tuple[tuple[int, int], str, object]]:
    """(first plan node and GPU, "node" or "spanning", plan node or replica name), one per group."""
    order: list[tuple[tuple[int, int], str, object]] = [
        ((node, min(g for b in bundles for g in b.gpus)), "node", node) for node, bundles in layout.nodes.items()]
    order += [((group.slot.node, min(group.slot.gpus)), "spanning", name) for name, group in layout.spanning.items()]
    return order


def create_placement_group(
    bundles: list[dict[str, float]],
    strategy: str = "PACK",
    name: str = "",
    timeout_s: float = 30.0,
    node_id: str | None = None,
    bundle_node_ids: list[str] | None = None,
):
    """Reserve ``bundles`` and wait until they are placed.

    Ray leaves an unsatisfiable group pending forever, so we fail at once when
    the cluster could never hold it (too few resources in total, a bundle
    larger than every node, too few nodes for STRICT_SPREAD, too much for
    one node under STRICT_PACK), and after ``timeout_s`` when it could but the
    resources are held by others. The error names what is missing and what
    each node has. ``node_id`` pins every bundle to that Ray node,
    ``bundle_node_ids`` each bundle to its own."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    label = f"placement group {name or '(unnamed)'} ({strategy}, {len(bundles)} bundles)"
    pins = bundle_node_ids or ([node_id] * len(bundles) if node_id else None)
    nodes = [n for n in _alive_nodes(ray) if pins is None or n["NodeID"] in pins]
    reason = _never_fits(bundles, strategy, nodes) if not bundle_node_ids else _pins_never_fit(bundles, pins, nodes)
    if reason:
        raise ClusterError(f"{label} can never be placed: {reason}.\n{describe_resources()}")
    selector = [{NODE_ID_LABEL: pin} for pin in pins] if pins else None
    group = placement_group(bundles, strategy=strategy, name=name, bundle_label_selector=selector)
    if group.wait(timeout_seconds=timeout_s):
        return group
    remove_placement_group(group)
    shortfall = _shortfall(_total(bundles), ray.available_resources())
    raise ClusterError(
        f"{label} was not placed within {timeout_s:g} s: "
        f"{_format(shortfall) or 'enough in total, but not on the nodes the strategy allows'} "
        f"missing from what is free now (other actors or groups hold the rest).\n{describe_resources()}"
    )


def describe_resources() -> str:
    """Cluster totals, free resources, and each node's totals, for errors."""
    import ray

    lines = [
        f"cluster total: {_format(ray.cluster_resources(), hide_memory=True)}",
        f"available now: {_format(ray.available_resources(), hide_memory=True)}",
    ]
    for node in _alive_nodes(ray):
        lines.append(f"node {node['NodeManagerAddress']} total: {_format(node['Resources'], hide_memory=True)}")
    return "\n".join(lines)


def _alive_nodes(ray) -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def _never_fits(bundles: list[dict[str, float]], strategy: str, nodes: list[dict]) -> str | None:
    """Why no state of this cluster could hold the group, or None."""
    totals = _total(node["Resources"] for node in nodes)
    missing = _shortfall(_total(bundles), totals)
    if missing:
        return f"needs {_format(missing)} more than the whole cluster has"
    for index, bundle in enumerate(bundles):
        if not any(not _shortfall(bundle, node["Resources"]) for node in nodes):
            return f"bundle {index} {_format(bundle)} is larger than every node"
    if strategy == "STRICT_PACK" and not any(not _shortfall(_total(bundles), n["Resources"]) for n in nodes):
        return f"STRICT_PACK needs {_format(_total(bundles))} on one node"
    if strategy == "STRICT_SPREAD" and len(bundles) > len(nodes):
        return f"STRICT_SPREAD needs {len(bundles)} nodes, the cluster has {len(nodes)}"
    return None


def _pins_never_fit(bundles: list[dict[str, float]], pins: list[str], nodes: list[dict]) -> str | None:
    """Why the bundles pinned to each Ray node could never all fit it, or None."""
    by_id = {node["NodeID"]: node for node in nodes}
    for pin in dict.fromkeys(pins):
        need = _total(b for b, p in zip(bundles, pins) if p == pin)
        node = by_id.get(pin)
        if node is None:
            return f"its Ray node {pin[:8]} is gone"
        missing = _shortfall(need, node["Resources"])
        if missing:
            return (f"the bundles pinned to {node['NodeManagerAddress']} ({pin[:8]}) need {_format(missing)} "
                    "more than it has")
    return None


def _total(resource_dicts) -> dict[str, float]:
    total: dict[str, float] = {}
    for resources in resource_dicts:
        for key, amount in resources.items():
            total[key] = total.get(key, 0.0) + amount
    return total


def _shortfall(needed: dict[str, float], have: dict[str, float]) -> dict[str, float]:
    return {k: v - have.get(k, 0.0) for k, v in needed.items() if v - have.get(k, 0.0) > 1e-9}


def _format(resources: dict[str, float], hide_memory: bool = False) -> str:
    """'CPU=8, GPU=2'; node-identity resources (and memory, if asked) left out as noise."""
    shown = {
        k: v for k, v in sorted(resources.items()) if not k.startswith("node:") and not (hide_memory and "memory" in k)
    }
    return ", ".join(f"{k}={v:g}" for k, v in shown.items())
