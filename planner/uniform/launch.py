"""Devices for a stock layout that stock launchers can start: each node one contiguous block of ranks.

torchrun and DeepSpeed's launcher number ranks node by node, and Megatron-LM (its default order),
DeepSpeed (topology axes pipe, data, model) and torchtitan (mesh pp, dp, tp, outermost first) all order
ranks tp fastest, then dp, then pp. In the sequence of a layout's cells, stage by stage and replica by
replica within a stage, every node must therefore own one run of consecutive cells: its full-speed TP
groups on its full-speed cells, its degraded groups on cells of their speed. A placement of degraded
groups (`placements.Placement`) leaves free which replica index holds which speed row (every distinct
order is tried while there are at most 64; beyond, slow rows first, last and evenly spaced), which
nodes come in which order, and how many cells each takes; `launch_grid` searches those.

The tiling is a depth-first search over the cell sequence. Nodes with the same full-speed slot count
and degraded speeds are interchangeable (healthy nodes, nodes that lost the same number of GPUs), so
the search state is the position and how many nodes of each kind are used. A run needs only be tried
at its longest, or ending just before a degraded cell: a run followed by a full-speed cell could take
that cell from the next run (which, left empty, is dropped), unless the node has no slot left, which
is its longest run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from math import factorial, prod

from planner.devices import Slot, damaged_node_slots, healthy_node_groups
from planner.problem import ClusterState, PlanningProblem
from planner.uniform.placements import Placement


@dataclass(frozen=True)
class _NodeKind:
    full: int  # full-speed TP groups
    degraded: tuple[float, ...]  # speeds of its degraded TP groups, sorted


def node_slots(cluster: ClusterState, tp: int) -> dict[int, tuple[list[Slot], list[Slot]]]:
    """Per node, its full-speed and its degraded TP groups; computed once per cluster state and size."""
    key = ("node_slots", tp)
    if key not in cluster.memo:
        cluster.memo[key] = _make_node_slots(cluster, tp)
    return cluster.memo[key]


def _make_node_slots(cluster: ClusterState, tp: int) -> dict[int, tuple[list[Slot], list[Slot]]]:
    if tp > cluster.gpus_per_node:  # whole-node groups, listed under their first node
        out = {node: ([], []) for node in range(cluster.num_nodes)}
        every_gpu = tuple(range(cluster.gpus_per_node))
        for nodes in healthy_node_groups(cluster, tp):
            out[nodes[0]] = ([Slot(nodes[0], every_gpu, 1.0, nodes)], [])
        return out
    out = {}
    for node in range(cluster.num_nodes):
        if node in cluster.damaged_nodes:
            slots = damaged_node_slots(cluster, node, tp)
        else:
            slots = [Slot(node, tuple(range(g * tp, (g + 1) * tp)), 1.0) for g in range(cluster.gpus_per_node // tp)]
        out[node] = ([s for s in slots if s.speed >= 1.0], [s for s in slots if s.speed < 1.0])
    return out


def _multiset_permutations(items: list) -> list[tuple]:
    if not items:
        return [()]
    out = []
    for item in sorted(set(items)):
        rest = list(items)
        rest.remove(item)
        out.extend((item, *tail) for tail in _multiset_permutations(rest))
    return out


def _arrangements(placement: Placement, dp: int, max_orders: int) -> list[tuple[tuple[float, ...], ...]]:
    """Replica orders of the placement's rows to try: every distinct one while there are at most
    `max_orders`, else slow rows first, last, and evenly spaced."""
    slow, healthy = list(placement.slow_rows), (1.0,) * placement.pp
    count = len(slow)
    if count == 0:
        return [placement.rows]
    distinct = factorial(dp) // factorial(dp - count) // prod(factorial(n) for n in Counter(slow).values())
    if distinct <= max_orders:
        return _multiset_permutations(list(placement.rows))
    spaced = [healthy] * dp
    for i, row in enumerate(slow):
        spaced[i * dp // count] = row
    orders = [placement.rows, ((healthy,) * (dp - count)) + tuple(slow), tuple(spaced)]
    return list(dict.fromkeys(orders))


def _options(needs: list[float], start: int, kind: _NodeKind) -> list[int]:
    """Run lengths from `start` a node of `kind` can serve: the longest, then those ending before a
    degraded cell, longest first."""
    free = Counter(kind.degraded)
    full = kind.full
    longest = 0
    for k in range(start, len(needs)):
        if needs[k] >= 1.0:
            if full == 0:
                break
            full -= 1
        else:
            if free[needs[k]] == 0:
                break
            free[needs[k]] -= 1
        longest += 1
    if longest == 0:
        return []
    shorter = [n for n in range(longest - 1, 0, -1) if needs[start + n] < 1.0]
    return [longest, *shorter]


def _choices(needs: list[float], start: int, used: tuple[int, ...], kinds: list[_NodeKind], available: list[int]):
    for index, kind in enumerate(kinds):
        if used[index] < available[index]:
            for length in _options(needs, start, kind):
                yield index, length


def _tile(needs: list[float], kinds: list[_NodeKind], available: list[int], max_dead_ends: int):
    """Runs (kind, length) covering `needs` in order, or None (also after `max_dead_ends` backtracks).
    Iterative: the largest clusters take thousands of runs."""
    failed: set[tuple[int, tuple[int, ...]]] = set()
    used0 = (0,) * len(kinds)
    stack = [(0, used0, _choices(needs, 0, used0, kinds, available))]
    path: list[tuple[int, int]] = []
    while stack:
        start, used, choices = stack[-1]
        for index, length in choices:
            after = start + length
            if after == len(needs):
                return [*path, (index, length)]
            state = (after, used[:index] + (used[index] + 1,) + used[index + 1:])
            if state in failed:
                continue
            path.append((index, length))
            stack.append((*state, _choices(needs, after, state[1], kinds, available)))
            break
        else:
            failed.add((start, used))
            if len(failed) >= max_dead_ends:
                return None
            stack.pop()
            if path:
                path.pop()
    return None


def launch_grid(cluster: ClusterState, tp: int, pp: int, dp: int, placement: Placement,
                max_dead_ends: int = 2000, max_orders: int = 64) -> list[list[Slot]] | None:
    """slots[replica][stage] with every node one run in tp-dp-pp rank order, the degraded groups as
    `placement` puts them (up to the order of replicas); None if none is found within `max_dead_ends` backtracks."""
    slots = node_slots(cluster, tp)
    nodes_of: dict[_NodeKind, list[int]] = {}
    for node, (full, degraded) in slots.items():
        nodes_of.setdefault(_NodeKind(len(full), tuple(sorted(s.speed for s in degraded))), []).append(node)
    kinds = sorted(nodes_of, key=lambda kind: nodes_of[kind][0])  # the first node first, as ranks go
    available = [len(nodes_of[kind]) for kind in kinds]
    for rows in _arrangements(placement, dp, max_orders):
        needs = [rows[r][s] for s in range(pp) for r in range(dp)]
        runs = _tile(needs, kinds, available, max_dead_ends)
        if runs is not None:
            return _grid(rows, runs, kinds, nodes_of, slots, pp, dp)
    return None


def _grid(rows, runs, kinds, nodes_of, slots, pp: int, dp: int) -> list[list[Slot]]:
    grid: list[list[Slot | None]] = [[None] * pp for _ in range(dp)]
    taken = Counter()
    k = 0
    for index, length in runs:
        kind = kinds[index]
        node = nodes_of[kind][taken[kind]]
        taken[kind] += 1
        full, degraded = list(slots[node][0]), list(slots[node][1])
        for _ in range(length):
            stage, replica = divmod(k, dp)
            speed = rows[replica][stage]
            if speed >= 1.0:
                grid[replica][stage] = full.pop(0)
            else:
                grid[replica][stage] = degraded.pop(next(i for i, s in enumerate(degraded) if s.speed == speed))
            k += 1
    return grid  # type: ignore[return-value]


def placement_grid(problem: PlanningProblem, tp: int, pp: int, dp: int, placement: Placement) -> list[list[Slot]] | None:
    """`launch_grid` with the planner's limits (`PlannerConfig.launch_dead_ends`, `launch_replica_orders`)."""
    config = problem.config
    return launch_grid(problem.cluster, tp, pp, dp, placement, config.launch_dead_ends, config.launch_replica_orders)
