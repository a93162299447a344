"""Placement-group bundles shaped like the actors that use them (no Ray here).

Ray schedules an actor into exactly one bundle, and an actor may ask for a
fraction of a GPU only below one GPU. So a bundle holds exactly the GPUs its
actors drive: one GPU for a trainer rank or a tp = 1 generator (colocated
actors share it, each asking its fraction), k GPUs for one actor driving a
tp = k replica. Each bundle also holds the CPU share of every actor in it.

A replica that spans nodes (vLLM with pp > 1) has its actor in the bundle
of its first node's GPUs and, on each further node, a bundle of its GPUs
there with no actor in it: reserved for the engine's own workers.

A k-GPU actor that shares its GPUs with another actor cannot be expressed
in Ray's resource model (it would need a fraction of each of k GPUs); the
layout refuses it with the reason instead of starting something Ray can
never place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from rldsl.plan import ExecutionPlan


class LayoutError(ValueError):
    """The plan asks for a placement Ray cannot express."""


@dataclass(frozen=True)
class ActorSlot:
    """One GPU actor of the plan: where the plan puts it."""

    name: str  # the Ray actor name: `stage-rank`, or `pipeline/stage-rank` when several pipelines run
    stage: str
    rank: int
    node: int  # the plan's node index
    gpus: tuple[int, ...]  # the plan's local GPU ids on that node
    gpu_fraction: float  # of each GPU; below 1 when colocated
    remote: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (node, local GPUs) its engine drives elsewhere


@dataclass
class Bundle:
    node: int
    index: int  # the bundle index inside the node's placement group
    gpus: tuple[int, ...]
    residents: list[ActorSlot] = field(default_factory=list)
    reserved_for: list[ActorSlot] = field(default_factory=list)  # replicas whose remote GPUs these are

    def resources(self, actor_cpus: float) -> dict[str, float]:
        cpus = actor_cpus * len(self.residents)  # a filler holds no actor, so no CPU
        return {"GPU": float(len(self.gpus)), **({"CPU": cpus} if cpus else {})}


@dataclass(frozen=True)
class BundleLayout:
    nodes: dict[int, list[Bundle]]  # plan node -> its bundles, in GPU order
    actor_cpus: float

    def slots(self) -> list[ActorSlot]:
        return [slot for bundles in self.nodes.values() for bundle in bundles for slot in bundle.residents]

    def slot(self, name: str) -> ActorSlot:
        return next(slot for slot in self.slots() if slot.name == name)

    def bundle_of(self, slot: ActorSlot) -> Bundle:
        return next(b for b in self.nodes[slot.node] if slot in b.residents)

    def num_gpus(self, slot: ActorSlot) -> float:
        """What the actor asks Ray for inside its bundle: whole GPUs when it
        has them alone, its fraction of the one GPU it shares otherwise."""
        bundle = self.bundle_of(slot)
        return float(len(slot.gpus)) if len(bundle.residents) == 1 else slot.gpu_fraction

    def node_needs(self) -> dict[int, dict[str, float]]:
        """Plan node -> the resources its placement group reserves."""
        needs = {}
        for node, bundles in self.nodes.items():
            total: dict[str, float] = {}
            for bundle in bundles:
                for key, amount in bundle.resources(self.actor_cpus).items():
                    total[key] = total.get(key, 0.0) + amount
            needs[node] = total
        return needs


def actor_slots(plan: ExecutionPlan) -> list[ActorSlot]:
    """Every GPU actor of every pipeline, named as the lowering names them."""
    prefix = len(plan.pipelines) > 1
    return [ActorSlot(f"{pipe.name}/" * prefix + f"{stage.name}-{rank.index}", stage.name, rank.index, rank.node,
                      tuple(rank.gpus), rank.gpu_fraction or 1.0, tuple((r.node, tuple(r.gpus)) for r in rank.remote))
            for pipe in plan.pipelines for stage in pipe.stages if stage.kind != "sync"
            for rank in stage.ranks if rank.gpus]


def layout_bundles(slots: list[ActorSlot], actor_cpus: float, gpus_per_node: int | None = None) -> BundleLayout:
    """Group each node's GPUs into bundles: GPUs driven by one actor belong
    to one bundle (connected components of the actors' GPU sets).

    Ray numbers a bundle's devices in the order the bundles are placed, from
    the node's first free GPU. So that its numbers are the plan's on a free
    node, every GPU below the highest one the plan uses gets a bundle, an
    empty filler where no actor runs (``gpus_per_node``: up to that count,
    for plan nodes folded onto one local Ray node)."""
    nodes: dict[int, list[Bundle]] = {}
    for node in sorted({s.node for s in slots} | {n for s in slots for n, _ in s.remote}):
        on_node = [s for s in slots if s.node == node]
        remote = [(s, gpus) for s in slots for n, gpus in s.remote if n == node]
        graph = nx.Graph()
        for gpus in [s.gpus for s in on_node] + [gpus for _, gpus in remote]:
            graph.add_nodes_from(gpus)
            nx.add_path(graph, gpus)
        top = gpus_per_node if gpus_per_node else max(graph.nodes) + 1
        graph.add_nodes_from(range(top))  # fillers
        components = sorted(tuple(sorted(c)) for c in nx.connected_components(graph))
        bundles = [Bundle(node, i, gpus) for i, gpus in enumerate(components)]
        for slot in on_node:
            next(b for b in bundles if slot.gpus[0] in b.gpus).residents.append(slot)
        for slot, gpus in remote:
            next(b for b in bundles if gpus[0] in b.gpus).reserved_for.append(slot)
        for bundle in bundles:
            _require_expressible(bundle)
        nodes[node] = bundles
    return BundleLayout(nodes, actor_cpus)


def _require_expressible(bundle: Bundle) -> None:
    if bundle.reserved_for and (bundle.residents or len(bundle.reserved_for) > 1):
        owner = bundle.reserved_for[0]
        others = ", ".join(s.name for s in bundle.residents + bundle.reserved_for[1:])
        raise LayoutError(
            f"`{owner.name}` drives GPUs {', '.join(map(str, bundle.gpus))} of node {bundle.node} from another node "
            f"and shares them with {others}: a replica across nodes needs its GPUs to itself")
    if len(bundle.gpus) == 1 or len(bundle.residents) <= 1:
        return
    wide = next(s for s in bundle.residents if len(s.gpus) > 1)
    others = ", ".join(s.name for s in bundle.residents if s is not wide)
    raise LayoutError(
        f"`{wide.name}` drives GPUs {', '.join(map(str, wide.gpus))} of node {wide.node} as one actor and shares "
        f"them with {others}: Ray gives an actor either whole GPUs or a fraction of one GPU, never a fraction of "
        f"several. Give the multi-GPU replica GPUs of its own (or tp = 1 replicas when it must share)")
