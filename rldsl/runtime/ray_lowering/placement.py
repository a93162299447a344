"""Placement groups: reserve a plan's GPUs on a Ray cluster, or say why not."""

from __future__ import annotations

from rldsl.runtime.ray_lowering.cluster import ClusterError



def create_placement_group(
    bundles: list[dict[str, float]],
    strategy: str = "PACK",
    name: str = "",
    timeout_s: float = 30.0,
):
    """Reserve ``bundles`` and wait until they are placed.

    Ray leaves an unsatisfiable group pending forever, so we fail at once when
    the cluster could never hold it (too few resources in total, a bundle
    larger than every node, too few nodes for STRICT_SPREAD, too much for
    one node under STRICT_PACK), and after ``timeout_s`` when it could but the
    resources are held by others. The error names what is missing and what
    each node has."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    label = f"placement group {name or '(unnamed)'} ({strategy}, {len(bundles)} bundles)"
    reason = _never_fits(bundles, strategy, _alive_nodes(ray))
    if reason:
        raise ClusterError(f"{label} can never be placed: {reason}.\n{describe_resources()}")
    group = placement_group(bundles, strategy=strategy, name=name)
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
