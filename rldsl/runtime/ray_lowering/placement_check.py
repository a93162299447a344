"""Where the actors really landed, against the plan.

Every GPU actor reports its Ray node, ``ray.get_gpu_ids()`` and
``CUDA_VISIBLE_DEVICES`` once started (``actor_process.where``). The
plan is honoured when each actor is on the Ray node its plan node was
pinned to, holds as many devices as the plan gives it, and plan GPUs and
devices correspond one to one (colocated actors see the same device,
others never do). Device numbers that merely differ from the plan's ids (a
node whose first GPUs another job holds) are reported, not refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from rldsl.runtime.ray_lowering.actor_process import where
from rldsl.runtime.ray_lowering.bundles import ActorSlot
from rldsl.runtime.ray_lowering.placement import Reservation


class PlacementProbe:
    """A placeholder actor for ``rldsl run --dry-run``: placed like a stage
    actor, it only says where it landed."""

    def ready(self) -> bool:
        return True

    def placement(self) -> dict:
        return where()


@dataclass
class PlacementReport:
    rows: list[tuple[ActorSlot, dict]]
    errors: list[str]
    notes: list[str]

    def to_json(self, reservation: Reservation) -> dict:
        nodes = {str(k): {"node_id": n.node_id, "address": n.address} for k, n in sorted(reservation.nodes.items())}
        actors = {slot.name: {"plan_node": slot.node, "plan_gpus": list(slot.gpus), **report}
                  for slot, report in self.rows}
        return {"nodes": nodes, "folded": reservation.folded, "actors": actors, "notes": self.notes,
                "errors": self.errors}

    def table(self, reservation: Reservation) -> str:
        lines = [f"{'actor':<28} {'plan':<12} {'Ray node':<26} CUDA_VISIBLE_DEVICES"]
        for slot, report in self.rows:
            node = reservation.nodes[slot.node]
            plan = f"{slot.node}:{','.join(map(str, slot.gpus))}"
            lines.append(f"{slot.name:<28} {plan:<12} {node.label:<26} {report.get('cuda_visible_devices')}")
        return "\n".join(lines)


def check_placement(reservation: Reservation, reports: dict[str, dict], slots: list[ActorSlot]) -> PlacementReport:
    errors, notes = [], []
    device_of: dict[tuple[int, int], int] = {}  # (plan node, plan gpu) -> device id
    plan_of: dict[tuple[str, int], tuple[int, int]] = {}  # (Ray node, device id) -> (plan node, plan gpu)
    for slot in slots:
        report = reports[slot.name]
        node = reservation.nodes[slot.node]
        if report["node_id"] != node.node_id:
            errors.append(f"`{slot.name}` runs on Ray node {report['node_id'][:8]} ({report['node_ip']}); "
                          f"plan node {slot.node} was reserved on {node.label}")
        devices = report["gpu_ids"]
        if len(devices) != len(slot.gpus):
            errors.append(f"`{slot.name}` holds device(s) {devices}; the plan gives it {len(slot.gpus)} GPU(s)")
            continue
        visible = report.get("cuda_visible_devices")
        if visible is not None and visible != ",".join(map(str, devices)):
            errors.append(f"`{slot.name}`: CUDA_VISIBLE_DEVICES={visible!r} but Ray assigned {devices}")
        for gpu, device in zip(slot.gpus, devices):
            if device_of.setdefault((slot.node, gpu), device) != device:
                errors.append(f"plan GPU {slot.node}:{gpu} is device {device_of[(slot.node, gpu)]} for one actor "
                              f"and {device} for `{slot.name}`")
            if plan_of.setdefault((report["node_id"], device), (slot.node, gpu)) != (slot.node, gpu):
                other = plan_of[(report["node_id"], device)]
                errors.append(f"device {device} of {node.label} serves plan GPUs {other[0]}:{other[1]} and "
                              f"{slot.node}:{gpu} (`{slot.name}`)")
        expected = reservation.expected_devices(slot)
        if tuple(devices) != expected and not errors:
            notes.append(f"`{slot.name}`: plan GPU(s) {slot.node}:{','.join(map(str, slot.gpus))} are device(s) "
                         f"{','.join(map(str, devices))} on {node.label}")
    return PlacementReport([(s, reports[s.name]) for s in slots], sorted(set(errors)), notes)
