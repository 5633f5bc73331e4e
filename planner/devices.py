"""Device ids, failure expansion, and stage-group slots (using node symmetry).

A slot is the group one pipeline stage runs on: `size` = tp x cp healthy GPUs (a TP group, or with
context parallelism cp of them, tp fastest). A group of at most a node's GPUs lies inside one node.
A larger one (context parallelism across nodes) is a multiple of whole nodes, taken from undamaged
nodes only: a node with a failed or slow GPU never joins one, which the plan's declared space says.
Healthy nodes are interchangeable, so they are counted, not listed; only damaged nodes (with a failed
or slow GPU) get individual slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.device import DeviceIdError, DeviceSpec
from planner.errors import PlanningError
from planner.problem import ClusterState


def parse_device(text: str, num_nodes: int, gpus_per_node: int) -> tuple[int, int | None]:
    """(node, gpu) from "node:gpu", gpu None for "node:*"; PlanningError if malformed or out of range."""
    try:
        spec = DeviceSpec.parse(text)
    except DeviceIdError as error:
        raise PlanningError(str(error)) from None
    node, gpu = spec.node, spec.gpu
    if node >= num_nodes:
        raise PlanningError(f"device {text!r} names node {node}, but the cluster has nodes 0..{num_nodes - 1}")
    if gpu is None:
        return node, None
    if gpu >= gpus_per_node:
        raise PlanningError(f"device {text!r} names GPU {gpu}, but each node has GPUs 0..{gpus_per_node - 1}")
    return node, gpu


def build_cluster_state(
    num_nodes: int, gpus_per_node: int, failed: list[str], slow: list[tuple[str, float]]
) -> ClusterState:
    failed_set: set[tuple[int, int]] = set()
    for text in failed:
        node, gpu = parse_device(text, num_nodes, gpus_per_node)
        if gpu is None:
            failed_set.update((node, g) for g in range(gpus_per_node))
        else:
            failed_set.add((node, gpu))
    slow_map: dict[tuple[int, int], float] = {}
    for text, speed in slow:
        node, gpu = parse_device(text, num_nodes, gpus_per_node)
        if (node, gpu) in slow_map and slow_map[(node, gpu)] != speed:
            raise PlanningError(f"slow device {text!r} is listed twice with different speeds")
        slow_map[(node, gpu)] = speed
    slow_items = tuple(
        sorted(((d, s) for d, s in slow_map.items() if d not in failed_set and s < 1.0), key=lambda item: item[0])
    )
    return ClusterState(num_nodes, gpus_per_node, frozenset(failed_set), slow_items)


@dataclass(frozen=True)
class Slot:
    """A stage's group: `devices` on one node, as fast as its slowest member; a group spanning whole
    nodes lists them in `nodes` (its first is `node`) and `devices` are every node's GPUs."""

    node: int
    devices: tuple[int, ...]
    speed: float
    nodes: tuple[int, ...] = ()

    @property
    def members(self) -> tuple[tuple[int, int], ...]:
        """(node, gpu) of every GPU, node by node: tp consecutive ones per CP rank."""
        return tuple((node, gpu) for node in (self.nodes or (self.node,)) for gpu in self.devices)


def nodes_per_group(gpus_per_node: int, size: int) -> int | None:
    """Whole nodes a group of `size` GPUs spans: 0 when it fits inside one node, None when it is
    larger but not a multiple of a node."""
    if size <= gpus_per_node:
        return 0
    return size // gpus_per_node if size % gpus_per_node == 0 else None


def healthy_node_groups(cluster: ClusterState, size: int) -> list[tuple[int, ...]]:
    """The undamaged nodes, in index order, cut into groups of `size` GPUs (whole nodes each)."""
    span = nodes_per_group(cluster.gpus_per_node, size)
    if not span:
        return []
    healthy = [node for node in range(cluster.num_nodes) if node not in cluster.damaged_nodes]
    return [tuple(healthy[start:start + span]) for start in range(0, len(healthy) - span + 1, span)]


def damaged_node_slots(cluster: ClusterState, node: int, tp: int) -> list[Slot]:
    """Slots of one damaged node: healthy GPUs fastest first, grouped consecutively.

    Grouping in speed order keeps slow GPUs together, so they drag down as
    few groups as possible; leftover GPUs (fewer than tp) stay unused.
    """
    healthy = cluster.healthy_by_speed.get(node)
    if healthy is None:
        healthy = tuple((g, 1.0) for g in range(cluster.gpus_per_node))
    slots = []
    for start in range(0, len(healthy) - tp + 1, tp):
        block = healthy[start : start + tp]
        # Fastest first, so the block's last GPU is its slowest.
        slots.append(Slot(node, tuple(sorted(g for g, _ in block)), block[-1][1]))
    return slots


@dataclass(frozen=True)
class SlotInventory:
    """Slots for one TP size: full-speed ones counted, degraded ones listed fastest first."""

    tp: int
    full_speed_count: int
    degraded: tuple[Slot, ...]

    @property
    def total(self) -> int:
        return self.full_speed_count + len(self.degraded)


def slot_inventory(cluster: ClusterState, tp: int) -> SlotInventory:
    """The cluster's slots for groups of `tp` GPUs (a stage's tp x cp); computed once per cluster state and size."""
    key = ("slot_inventory", tp)
    if key not in cluster.memo:
        cluster.memo[key] = _slot_inventory(cluster, tp)
    return cluster.memo[key]


def _slot_inventory(cluster: ClusterState, tp: int) -> SlotInventory:
    if tp > cluster.gpus_per_node:
        return SlotInventory(tp, len(healthy_node_groups(cluster, tp)), ())
    per_healthy_node = cluster.gpus_per_node // tp
    damaged = cluster.damaged_nodes
    full_speed = (cluster.num_nodes - len(damaged)) * per_healthy_node
    degraded: list[Slot] = []
    ranked = cluster.healthy_by_speed
    for node in sorted(damaged):
        healthy = ranked[node]
        for start in range(0, len(healthy) - tp + 1, tp):
            block = healthy[start : start + tp]
            if block[-1][1] >= 1.0:
                full_speed += 1
            else:
                degraded.append(Slot(node, tuple(sorted(g for g, _ in block)), block[-1][1]))
    # Made in (node, devices) order, so a stable sort by speed alone orders by (-speed, node, devices).
    degraded.sort(key=_speed, reverse=True)
    return SlotInventory(tp, full_speed, tuple(degraded))


def _speed(slot: Slot) -> float:
    return slot.speed
