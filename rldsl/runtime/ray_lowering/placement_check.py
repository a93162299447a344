"""Where the actors really landed, against the plan.

Every GPU actor reports its Ray node, ``ray.get_gpu_ids()`` and
``CUDA_VISIBLE_DEVICES`` once started (``actor_process.where``). The
plan is honoured when each actor is on the Ray node its plan node was
pinned to, holds as many devices as the plan gives it, and plan GPUs and
devices correspond one to one (colocated actors see the same device,
others never do). Device numbers that merely differ from the plan's ids (a
node whose first GPUs another job holds) are reported, not refused.

A replica whose engine's Ray workers take its GPUs (across nodes: the GPU
bundles of its own group; on GPUs it shares: the bundles of its GPUs in its
node's group) holds no GPU itself. Its dry-run probe starts a task in each
of those bundles asking what each worker asks, from the variables vLLM's
Ray executor reads (``VLLM_RAY_BUNDLE_INDICES``, ``VLLM_RAY_PER_WORKER_GPUS``),
and each is checked like an actor of one GPU; a real run checks the
actor's node only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rldsl.runtime.ray_lowering.actor_process import where
from rldsl.layout import ActorSlot
from rldsl.runtime.ray_lowering.placement import Reservation

ENGINE_WORKERS = "engine_workers"  # in a probe's report: where each GPU bundle of its group landed
_PROBE_TIMEOUT_S = 120.0


class PlacementProbe:
    """A placeholder actor for ``rldsl run --dry-run``: placed like a stage
    actor, it only says where it landed (and, holding no GPU, where the
    GPU bundles of its group land)."""

    def ready(self) -> bool:
        return True

    def placement(self) -> dict:
        report = where()
        if not report["gpu_ids"]:
            report[ENGINE_WORKERS] = probe_gpu_bundles()
        return report


def probe_gpu_bundles() -> list[dict]:
    """From an actor in a placement group: a task in each bundle where
    vLLM's Ray executor would put a worker (the bundles its
    ``VLLM_RAY_BUNDLE_INDICES`` names, else every GPU bundle in order), asking
    the GPUs each worker asks (``VLLM_RAY_PER_WORKER_GPUS``, else one), and
    where each landed."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.get_current_placement_group()
    if group is None:
        return []
    named = os.environ.get("VLLM_RAY_BUNDLE_INDICES")
    indices = [int(i) for i in named.split(",")] if named else \
        [i for i, bundle in enumerate(group.bundle_specs) if bundle.get("GPU")]
    gpus = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS") or 1)
    probe = ray.remote(where)
    calls = [probe.options(num_cpus=0, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(group, i))
             .remote() for i in indices]
    return ray.get(calls, timeout=_PROBE_TIMEOUT_S)


@dataclass
class PlacementReport:
    rows: list[tuple[ActorSlot, dict]]
    errors: list[str]
    notes: list[str]

    def to_json(self, reservation: Reservation) -> dict:
        nodes = {str(k): {"node_id": n.node_id, "address": n.address} for k, n in sorted(reservation.nodes.items())}
        actors = {slot.name: {"plan_node": slot.node, "plan_gpus": list(slot.gpus),
                              **({"plan_remote": [[n, list(g)] for n, g in slot.remote]} if slot.remote else {}),
                              **report}
                  for slot, report in self.rows}
        return {"nodes": nodes, "folded": reservation.folded, "actors": actors, "notes": self.notes,
                "errors": self.errors}

    def table(self, reservation: Reservation) -> str:
        lines = [f"{'actor':<28} {'plan':<12} {'Ray node':<26} CUDA_VISIBLE_DEVICES"]
        for slot, report in self.rows:
            node = reservation.nodes[slot.node]
            plan = "+".join(f"{n}:{','.join(map(str, gpus))}" for n, gpus in ((slot.node, slot.gpus), *slot.remote))
            bundles = reservation.layout.worker_bundles(slot)
            devices = "(its workers')" if bundles else report.get("cuda_visible_devices")
            lines.append(f"{slot.name:<28} {plan:<12} {node.label:<26} {devices}")
            for bundle, worker in zip(bundles, report.get(ENGINE_WORKERS) or []):
                label = reservation.nodes[bundle.node].label
                lines.append(f"{'  worker ' + str(bundle.index):<28} {f'{bundle.node}:{bundle.gpus[0]}':<12} "
                             f"{label:<26} {worker.get('cuda_visible_devices')}")
        return "\n".join(lines)


def check_placement(reservation: Reservation, reports: dict[str, dict], slots: list[ActorSlot]) -> PlacementReport:
    check = _Check(reservation)
    for slot in slots:
        if reservation.layout.worker_bundles(slot):
            check.replica_of_workers(slot, reports[slot.name])
        else:
            check.actor(slot, reports[slot.name])
    return PlacementReport([(s, reports[s.name]) for s in slots], sorted(set(check.errors)), check.notes)


@dataclass
class _Check:
    reservation: Reservation
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    device_of: dict[tuple[int, int], int] = field(default_factory=dict)  # (plan node, plan gpu) -> device id
    plan_of: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # (Ray node, device) -> plan GPU

    def actor(self, slot: ActorSlot, report: dict) -> None:
        self._on_its_node(slot.name, slot.node, report)
        devices = report["gpu_ids"]
        if len(devices) != len(slot.gpus):
            self.errors.append(f"`{slot.name}` holds device(s) {devices}; the plan gives it {len(slot.gpus)} GPU(s)")
            return
        visible = report.get("cuda_visible_devices")
        if visible is not None and visible != ",".join(map(str, devices)):
            self.errors.append(f"`{slot.name}`: CUDA_VISIBLE_DEVICES={visible!r} but Ray assigned {devices}")
        for gpu, device in zip(slot.gpus, devices):
            self._one_to_one(slot.name, slot.node, gpu, device, report["node_id"])
        expected = self.reservation.expected_devices(slot)
        if tuple(devices) != expected and not self.errors:
            self.notes.append(f"`{slot.name}`: plan GPU(s) {slot.node}:{','.join(map(str, slot.gpus))} are "
                              f"device(s) {','.join(map(str, devices))} on {self.reservation.nodes[slot.node].label}")

    def replica_of_workers(self, slot: ActorSlot, report: dict) -> None:
        """The actor on its first node holding no GPU; each GPU bundle its
        probe reached on the Ray node of its plan node, one device each."""
        self._on_its_node(slot.name, slot.node, report)
        if report["gpu_ids"]:
            self.errors.append(f"`{slot.name}` holds device(s) {report['gpu_ids']}; its engine's workers take its "
                               "GPUs")
        workers = report.get(ENGINE_WORKERS)
        bundles = self.reservation.layout.worker_bundles(slot)
        if workers is None:  # a real run: vLLM's workers hold the bundles, a probe could not get in
            self.notes.append(f"`{slot.name}`: its engine's Ray workers hold its {len(bundles)} GPU bundle(s) "
                              "(`rldsl run --dry-run` checks where they land)")
            return
        if len(workers) != len(bundles):
            self.errors.append(f"`{slot.name}`: its group has {len(workers)} GPU bundle(s); the plan gives it "
                               f"{len(bundles)} GPU(s)")
            return
        for bundle, worker in zip(bundles, workers):
            name, (node, gpu) = f"{slot.name} worker {bundle.index}", (bundle.node, bundle.gpus[0])
            self._on_its_node(name, node, worker)
            if len(worker["gpu_ids"]) != 1:
                self.errors.append(f"`{name}` holds device(s) {worker['gpu_ids']}; the plan gives it GPU {node}:{gpu}")
                continue
            device = worker["gpu_ids"][0]
            self._one_to_one(name, node, gpu, device, worker["node_id"])
            if device != self.reservation.expected_device(node, gpu) and not self.errors:
                self.notes.append(f"`{name}`: plan GPU {node}:{gpu} is device {device} on "
                                  f"{self.reservation.nodes[node].label}")

    def _on_its_node(self, name: str, plan_node: int, report: dict) -> bool:
        node = self.reservation.nodes[plan_node]
        if report["node_id"] == node.node_id:
            return True
        self.errors.append(f"`{name}` runs on Ray node {report['node_id'][:8]} ({report['node_ip']}); "
                           f"plan node {plan_node} was reserved on {node.label}")
        return False

    def _one_to_one(self, name: str, plan_node: int, gpu: int, device: int, ray_node: str) -> None:
        """Plan GPU and device correspond one to one across every actor."""
        if self.device_of.setdefault((plan_node, gpu), device) != device:
            self.errors.append(f"plan GPU {plan_node}:{gpu} is device {self.device_of[(plan_node, gpu)]} for one "
                               f"actor and {device} for `{name}`")
        if self.plan_of.setdefault((ray_node, device), (plan_node, gpu)) != (plan_node, gpu):
            other = self.plan_of[(ray_node, device)]
            label = self.reservation.nodes[plan_node].label
            self.errors.append(f"device {device} of {label} serves plan GPUs {other[0]}:{other[1]} and "
                               f"{plan_node}:{gpu} (`{name}`)")
