"""TP groups of damaged nodes: stage types, per-node partitions, and classes of alike nodes.

A damaged node (one with a failed or slow GPU) may cut its healthy GPUs into
TP groups of any allowed sizes up to the healthy nodes' TP size. Its GPUs are
sorted fastest first and cut into contiguous blocks, larger blocks first, so
the biggest groups get the fastest GPUs and slow GPUs end up together.
Only maximal partitions are listed (no leftover that could form a group):
any group may still stay unused. Damaged nodes with the same speed profile
are interchangeable, so they form one class with a count.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from planner.problem import ClusterState


class StageType(NamedTuple):
    """A TP group's size and speed (its slowest member's); with context parallelism the stage group is cp
    such TP groups (`OuterChoice.cp`), its speed the slowest of them all.

    A named tuple rather than a frozen dataclass: stage types key most of the search's memo tables, and a
    tuple hashes and compares in C (a dataclass's generated `__eq__` ran half a million times per 256-GPU
    failure-aware solve). Ordered by (tp, speed)."""

    tp: int
    speed: float


@dataclass(frozen=True)
class NodeClass:
    """Damaged nodes with one speed profile (healthy GPUs' speeds, fastest first)."""

    profile: tuple[float, ...]
    nodes: tuple[int, ...]


@dataclass(frozen=True)
class Partition:
    """Groups of one node, in block order (block i takes the next `groups[i].tp` x cp fastest GPUs, cp the
    layout's context-parallel ranks)."""

    groups: tuple[StageType, ...]

    def counts(self) -> Counter[StageType]:
        return Counter(self.groups)


def node_profile(cluster: ClusterState, node: int) -> tuple[float, ...]:
    return tuple(speed for _, speed in cluster.healthy_by_speed[node])


def damaged_classes(cluster: ClusterState) -> list[NodeClass]:
    """Damaged nodes grouped by speed profile, in order of their first node; once per cluster state."""
    if "damaged_classes" not in cluster.memo:
        by_profile: dict[tuple[float, ...], list[int]] = {}
        for node in sorted(cluster.damaged_nodes):
            by_profile.setdefault(node_profile(cluster, node), []).append(node)
        cluster.memo["damaged_classes"] = tuple(
            NodeClass(profile, tuple(nodes)) for profile, nodes in sorted(by_profile.items(), key=lambda kv: kv[1][0])
        )
    return list(cluster.memo["damaged_classes"])


def _size_sequences(total: int, sizes: tuple[int, ...], largest: int) -> list[tuple[int, ...]]:
    """Non-increasing sequences of `sizes` (each <= largest) summing to at most `total`, to which
    no further size fits."""
    options = sorted((s for s in sizes if s <= min(largest, total)), reverse=True)
    if not options:
        return [()]
    return [(size, *rest) for size in options for rest in _size_sequences(total - size, sizes, size)]


def node_partitions(profile: tuple[float, ...], sizes: tuple[int, ...], cp: int = 1) -> list[Partition]:
    """Maximal partitions of a node with this profile into groups of the given TP sizes, each group of a TP size
    tp taking tp x cp GPUs (`cp` context-parallel ranks of it)."""
    if not profile or not sizes:
        return [Partition(())]
    partitions = []
    # A group of TP size s takes s cp GPUs, so in units of cp GPUs the node holds len // cp of them.
    for sequence in _size_sequences(len(profile) // cp, tuple(sorted(set(sizes))), max(sizes)):
        groups = []
        offset = 0
        for size in sequence:
            groups.append(StageType(size, min(profile[offset : offset + size * cp])))
            offset += size * cp
        partitions.append(Partition(tuple(groups)))
    return partitions
