"""Put a new layout on the devices that already hold most of what it needs.

The planner places a layout in node order; any placement that maps nodes to
nodes of the same health and GPUs to GPUs of the same speed has exactly the
same cost under the cost model (links are uniform within a node and across
nodes, and a TP group's speed is its slowest member's). Among those
placements this picks the one that moves the fewest bytes from the running
layout: per class of alike nodes, a min-cost assignment of the new layout's
node roles to physical nodes, each pair priced by the best assignment of the
role's GPUs to the node's GPUs of equal speed. Both assignments are exact.

Classes larger than `PlannerConfig.max_exact_nodes` nodes are not matched node to node
(quadratic in the class size); there each role stays on its node and only
its GPUs are matched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np
from ortools.graph.python import linear_sum_assignment

from cost_models.device import device_id, device_order
from cost_models.migration import Holding, UnitParams, missing_bytes
from planner.config import DEFAULT_CONFIG, PlannerConfig
from planner.problem import ClusterState
from planner.replan.holdings import device_holdings, placed_layout
from planner.result import PlanResult, ReplicaResult

# Assignment costs are integers: bytes in MiB lose nothing that matters.
_COST_UNIT_BYTES = 2**20

Role = tuple[Holding | None, ...]  # per GPU of a node: what the new layout needs there (None: unused)


def _min_cost_assignment(costs: np.ndarray) -> tuple[list[int], int]:
    """Column for each row minimizing the summed cost (square matrix of non-negative ints)."""
    size = costs.shape[0]
    if size == 1:
        return [0], int(costs[0, 0])
    solver = linear_sum_assignment.SimpleLinearSumAssignment()
    rows, cols = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    solver.add_arcs_with_cost(rows.ravel(), cols.ravel(), costs.ravel())
    if solver.solve() != solver.OPTIMAL:
        raise RuntimeError("linear sum assignment failed on a complete bipartite graph")
    return [solver.right_mate(i) for i in range(size)], int(solver.optimal_cost())


class _Matcher:
    def __init__(self, cluster: ClusterState, held: Mapping[str, Holding], units: UnitParams) -> None:
        self.cluster = cluster
        self.held = held
        self.units = units

    def speeds(self, node: int) -> tuple[float, ...]:
        return tuple(0.0 if (node, g) in self.cluster.failed else self.cluster.speed_of(node, g)
                     for g in range(self.cluster.gpus_per_node))

    def gpu_mapping(self, role: Role, role_speeds: tuple[float, ...], node: int) -> tuple[list[int], int]:
        """GPU of `node` for each GPU of the role, equal speeds only, fewest MiB received."""
        target_speeds = self.speeds(node)
        mapping = [0] * len(role)
        total = 0
        for speed in sorted(set(role_speeds)):
            sources = [g for g, s in enumerate(role_speeds) if s == speed]
            targets = [g for g, s in enumerate(target_speeds) if s == speed]
            costs = np.zeros((len(sources), len(targets)), dtype=np.int64)
            for i, g in enumerate(sources):
                if role[g] is None:
                    continue
                for j, t in enumerate(targets):
                    held = self.held.get(device_id(node, t), ())
                    costs[i, j] = int(missing_bytes(role[g], held, self.units) // _COST_UNIT_BYTES)
            columns, cost = _min_cost_assignment(costs)
            for i, j in enumerate(columns):
                mapping[sources[i]] = targets[j]
            total += cost
        return mapping, total


def matched_device_map(result: PlanResult, cluster: ClusterState, held: Mapping[str, Holding],
                       units: UnitParams, config: PlannerConfig = DEFAULT_CONFIG) -> dict[str, str]:
    """Planner device -> physical device, a cost-neutral relabelling that moves the fewest bytes."""
    needed = device_holdings(placed_layout(result))
    matcher = _Matcher(cluster, held, units)
    classes: dict[tuple[float, ...], list[int]] = {}
    for node in range(cluster.num_nodes):
        classes.setdefault(tuple(sorted(matcher.speeds(node))), []).append(node)
    device_map: dict[str, str] = {}
    for nodes in classes.values():
        roles = {node: tuple(needed.get(device_id(node, g)) for g in range(cluster.gpus_per_node)) for node in nodes}
        if len(nodes) > config.max_exact_nodes:
            chosen = {a: (a, matcher.gpu_mapping(roles[a], matcher.speeds(a), a)[0]) for a in nodes}
        else:
            pairs = [[matcher.gpu_mapping(roles[a], matcher.speeds(a), b) for b in nodes] for a in nodes]
            costs = np.array([[cost for _, cost in row] for row in pairs], dtype=np.int64)
            columns, _ = _min_cost_assignment(costs)
            chosen = {a: (nodes[j], pairs[i][j][0]) for i, (a, j) in enumerate(zip(nodes, columns))}
        for a, (b, gpus) in chosen.items():
            for g, t in enumerate(gpus):
                device_map[device_id(a, g)] = device_id(b, t)
    return device_map


def relabel(result: PlanResult, device_map: Mapping[str, str]) -> PlanResult:
    """The same plan with every device renamed (a permutation within equal-speed GPUs).

    A stage's devices stay in device order, which makes the i-th lowest its TP rank i: trainers form
    groups from rank lists that `torch.distributed.new_group` sorts (and Megatron-LM builds from
    rank ranges), so a TP rank order against device order could not be run. The matching above
    chooses which devices form each stage; this fixes their TP ranks, and the migration is priced
    on the result.
    """
    replicas = tuple(
        ReplicaResult(replica.id, replica.num_microbatches, tuple(
            replace(stage, devices=tuple(sorted((device_map.get(d, d) for d in stage.devices), key=device_order)))
            for stage in replica.stages
        ))
        for replica in result.replicas
    )
    unused = tuple(sorted((device_map.get(d, d) for d in result.unused_devices),
                          key=device_order))
    return replace(result, replicas=replicas, unused_devices=unused)
