"""Placement-group bundles shaped like the actors that use them (no Ray here).

Ray schedules an actor into exactly one bundle, and an actor may ask for a
fraction of a GPU only below one GPU. So a bundle holds exactly the GPUs its
actors drive: one GPU for a trainer rank or a tp = 1 generator (colocated
actors share it, each asking its fraction), k GPUs for one actor driving a
tp = k replica. Each bundle also holds the CPU share of every actor in it.

A replica that spans nodes (vLLM with pp > 1) gets a placement group of its
own, across nodes (``SpanningGroup``): one 1-GPU bundle per GPU it drives,
each on its plan node, and a CPU bundle on its first node for its actor.
vLLM's Ray executor starts its workers in the GPU bundles of the group its
engine runs in (1-GPU bundles only, the engine's node among them), so the
per-node groups leave those GPUs out.

A k-GPU actor that shares its GPUs with another actor cannot be expressed
in Ray's resource model (it would need a fraction of each of k GPUs). A
vLLM replica can leave its GPUs to its engine's workers instead (vLLM's Ray
executor, one worker per GPU): such a replica on GPUs another stage uses
(verl's tp = 2 rollout on its trainer's GPUs) keeps 1-GPU bundles, its
actor holds no GPU in the bundle of its first one, and its engine puts a
worker in each of its bundles asking the replica's fraction of that GPU
(``BundleLayout.workers``). Any other multi-GPU actor that shares its GPUs,
and a replica across nodes whose GPUs another actor uses (its engine's
workers each take a whole GPU), are refused with the reason instead of
starting something Ray can never place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from rldsl.plan import ExecutionPlan


# Engines whose replica may leave its GPUs to Ray workers of its engine, one per GPU (vLLM's Ray executor);
# SGLang's engine drives its GPUs from its own processes.
RAY_WORKER_ENGINES = ("vllm",)


class LayoutError(ValueError):
    """The plan asks for a placement Ray cannot express; ``stage`` is the
    stage whose actor cannot be laid out (the compiler points at it)."""

    def __init__(self, message: str, stage: str = "") -> None:
        super().__init__(message)
        self.stage = stage


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
    engine: str = ""  # its stage's engine: whether it may leave its GPUs to Ray workers (RAY_WORKER_ENGINES)

    def all_gpus(self) -> list[tuple[int, int]]:
        """(plan node, local GPU) of every GPU it drives, its own node first."""
        return [(self.node, g) for g in self.gpus] + [(n, g) for n, gpus in self.remote for g in gpus]


@dataclass
class Bundle:
    node: int
    index: int  # the bundle index inside its placement group
    gpus: tuple[int, ...]
    residents: list[ActorSlot] = field(default_factory=list)
    hosts_workers: bool = False  # a replica's engine puts a Ray worker on its GPU (a user that is no resident)

    def resources(self, actor_cpus: float) -> dict[str, float]:
        cpus = actor_cpus * len(self.residents)  # a filler or an engine worker's bundle holds no actor, no CPU
        return {**({"GPU": float(len(self.gpus))} if self.gpus else {}), **({"CPU": cpus} if cpus else {})}


@dataclass(frozen=True)
class SpanningGroup:
    """The placement group of one replica across nodes: its GPU bundles in
    the order of ``ActorSlot.all_gpus``, then its actor's CPU bundle."""

    slot: ActorSlot
    bundles: list[Bundle]

    @property
    def gpu_bundles(self) -> list[Bundle]:
        return [b for b in self.bundles if b.gpus]

    @property
    def actor_bundle(self) -> Bundle:
        return next(b for b in self.bundles if b.residents)


@dataclass(frozen=True)
class BundleLayout:
    nodes: dict[int, list[Bundle]]  # plan node -> the bundles of its own group, in GPU order
    actor_cpus: float
    spanning: dict[str, SpanningGroup] = field(default_factory=dict)  # replica actor name -> its group
    # a replica on shared GPUs -> the bundles of its node's group its engine's workers take, in its GPUs' order
    workers: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def slots(self) -> list[ActorSlot]:
        on_nodes = [slot for bundles in self.nodes.values() for bundle in bundles for slot in bundle.residents]
        return on_nodes + [group.slot for group in self.spanning.values()]

    def slot(self, name: str) -> ActorSlot:
        return next(slot for slot in self.slots() if slot.name == name)

    def bundle_of(self, slot: ActorSlot) -> Bundle:
        if slot.name in self.spanning:
            return self.spanning[slot.name].actor_bundle
        return next(b for b in self.nodes[slot.node] if slot in b.residents)

    def worker_bundles(self, slot: ActorSlot) -> list[Bundle]:
        """The GPU bundles its engine's Ray workers take, one each ([] when the actor drives its GPUs itself)."""
        if slot.name in self.spanning:
            return self.spanning[slot.name].gpu_bundles
        return [self.nodes[slot.node][index] for index in self.workers.get(slot.name, ())]

    def worker_gpus(self, slot: ActorSlot) -> float:
        """What each of its engine's workers asks of its GPU: the whole GPU across nodes, its share on a shared one."""
        return 1.0 if slot.name in self.spanning else slot.gpu_fraction

    def num_gpus(self, slot: ActorSlot) -> float:
        """What the actor asks Ray for inside its bundle: whole GPUs when it
        has them alone, its fraction of the one GPU it shares otherwise, none
        when its engine's workers hold its GPUs (``worker_bundles``)."""
        if slot.name in self.spanning or slot.name in self.workers:
            return 0.0
        bundle = self.bundle_of(slot)
        alone = len(bundle.residents) == 1 and not bundle.hosts_workers
        return float(len(slot.gpus)) if alone else slot.gpu_fraction

    def node_needs(self) -> dict[int, dict[str, float]]:
        """Plan node -> the resources reserved on it: its own group and its
        share of the groups across nodes."""
        needs: dict[int, dict[str, float]] = {}
        every = [b for bundles in self.nodes.values() for b in bundles]
        every += [b for group in self.spanning.values() for b in group.bundles]
        for bundle in every:
            total = needs.setdefault(bundle.node, {})
            for key, amount in bundle.resources(self.actor_cpus).items():
                total[key] = total.get(key, 0.0) + amount
        return dict(sorted(needs.items()))


def actor_slots(plan: ExecutionPlan) -> list[ActorSlot]:
    """Every GPU actor of every pipeline, named as the lowering names them."""
    prefix = len(plan.pipelines) > 1
    return [ActorSlot(f"{pipe.name}/" * prefix + f"{stage.name}-{rank.index}", stage.name, rank.index, rank.node,
                      tuple(rank.gpus), rank.gpu_fraction or 1.0, tuple((r.node, tuple(r.gpus)) for r in rank.remote),
                      stage.engine.name if stage.engine else "")
            for pipe in plan.pipelines for stage in pipe.stages if stage.kind != "sync"
            for rank in stage.own_ranks if rank.gpus]


def leaves_gpus_to_workers(engine: str, gpus: int, gpu_fraction: float) -> bool:
    """A replica whose engine's Ray workers take its GPUs: one of several
    GPUs that it shares with other actors (its fraction of each below one,
    as the plan gives it), on an engine that can. The one test of it: the
    layout, the engine factory and `plan` ask it alike."""
    return engine in RAY_WORKER_ENGINES and gpus > 1 and 0 < gpu_fraction < 1


def layout_bundles(slots: list[ActorSlot], actor_cpus: float, gpus_per_node: int | None = None) -> BundleLayout:
    """Group each node's GPUs into bundles: GPUs driven by one actor belong
    to one bundle (connected components of the actors' GPU sets); a replica
    across nodes gets a group of its own (``SpanningGroup``).

    Ray numbers a bundle's devices in the order the bundles are placed, from
    the node's first free GPU. So that its numbers are the plan's on a free
    node, every GPU below the highest one the plan uses gets a bundle, an
    empty filler where no actor runs (``gpus_per_node``: up to that count,
    for plan nodes folded onto one local Ray node); GPUs of replicas across
    nodes excepted, their own groups hold them."""
    spanning = [s for s in slots if s.remote]
    _require_own_gpus(spanning, slots)
    taken = {gpu for s in spanning for gpu in s.all_gpus()}
    nodes: dict[int, list[Bundle]] = {}
    by_node: dict[int, list[ActorSlot]] = {}  # one pass: a scan per node made `check` quadratic in the cluster
    for slot in slots:
        if not slot.remote:
            by_node.setdefault(slot.node, []).append(slot)
    workers: dict[str, tuple[int, ...]] = {}
    for node, on_node in sorted(by_node.items()):
        split = [slot for slot in on_node if leaves_gpus_to_workers(slot.engine, len(slot.gpus), slot.gpu_fraction)]
        graph = nx.Graph()
        for slot in on_node:
            graph.add_nodes_from(slot.gpus)
            if slot not in split:  # one actor's GPUs make one bundle
                nx.add_path(graph, slot.gpus)
        top = gpus_per_node if gpus_per_node else max(graph.nodes) + 1
        graph.add_nodes_from(g for g in range(top) if (node, g) not in taken)  # fillers
        components = sorted(tuple(sorted(c)) for c in nx.connected_components(graph))
        bundles = [Bundle(node, i, gpus) for i, gpus in enumerate(components)]
        index_of = {gpu: bundle.index for bundle in bundles for gpu in bundle.gpus}
        for slot in on_node:
            bundles[index_of[slot.gpus[0]]].residents.append(slot)
        workers.update({slot.name: tuple(index_of[gpu] for gpu in slot.gpus) for slot in split})
        for slot in split:
            for index in workers[slot.name]:
                bundles[index].hosts_workers = True
        for bundle in bundles:
            _require_expressible(bundle, workers)
        nodes[node] = bundles
    return BundleLayout(nodes, actor_cpus, {s.name: _spanning_group(s) for s in spanning}, workers)


def _spanning_group(slot: ActorSlot) -> SpanningGroup:
    gpus = slot.all_gpus()
    bundles = [Bundle(node, i, (gpu,)) for i, (node, gpu) in enumerate(gpus)]  # its engine's workers use them
    return SpanningGroup(slot, bundles + [Bundle(slot.node, len(gpus), (), residents=[slot])])


def _require_own_gpus(spanning: list[ActorSlot], slots: list[ActorSlot]) -> None:
    """A replica across nodes has its GPUs to itself: its engine's Ray
    workers each take a whole GPU of its group."""
    users: dict[tuple[int, int], list[int]] = {}  # (node, gpu) -> indexes of the slots on it, built once
    for index, slot in enumerate(slots):
        for gpu in slot.all_gpus():
            users.setdefault(gpu, []).append(index)
    for replica in spanning:
        mine = set(replica.all_gpus())
        others = sorted({i for gpu in mine for i in users.get(gpu, ()) if slots[i] is not replica})
        if others:  # named: the first other slot in plan order
            other = slots[others[0]]
            where = ", ".join(f"{node}:{gpu}" for node, gpu in sorted(mine & set(other.all_gpus())))
            raise LayoutError(
                f"`{replica.name}` spans nodes and shares GPU(s) {where} with {other.name}: a replica across "
                "nodes needs its GPUs to itself (vLLM's Ray executor gives each of its workers a whole GPU). "
                "Give the other stage GPUs of its own", replica.stage)


def _require_expressible(bundle: Bundle, workers: dict[str, tuple[int, ...]]) -> None:
    if len(bundle.gpus) == 1 or len(bundle.residents) <= 1:
        return
    wide = next(s for s in bundle.residents if len(s.gpus) > 1 and s.name not in workers)
    others = ", ".join(s.name for s in bundle.residents if s is not wide)
    raise LayoutError(
        f"`{wide.name}` drives GPUs {', '.join(map(str, wide.gpus))} of node {wide.node} as one actor and shares "
        f"them with {others}: Ray gives an actor either whole GPUs or a fraction of one GPU, never a fraction of "
        f"several; only vLLM's replicas leave their GPUs to Ray workers of their engine, one per GPU. Give the "
        f"multi-GPU replica GPUs of its own (or tp = 1 replicas when it must share)", wide.stage)
