"""Placements of degraded TP groups and the launch order of a stock layout, against brute force.

The brute forces here share no code with `planner.uniform.placements` or `planner.uniform.launch`: they
assign every group to every cell, and try every node order, run length and replica order.
"""

from __future__ import annotations

import itertools

import pytest

from planner.devices import build_cluster_state, slot_inventory
from planner.uniform.launch import launch_grid
from planner.uniform.placements import (
    Placement,
    all_placements,
    degraded_speeds_used,
    packed,
    placements,
    spread,
)


def _brute_placements(speeds: tuple[float, ...], pp: int, dp: int) -> set[tuple]:
    """Every assignment of the groups to distinct cells, as the multiset of its replicas' speed rows."""
    cells = list(itertools.product(range(dp), range(pp)))
    out = set()
    for chosen in itertools.permutations(cells, len(speeds)):
        rows = [[1.0] * pp for _ in range(dp)]
        for speed, (replica, stage) in zip(speeds, chosen):
            rows[replica][stage] = speed
        out.add(tuple(sorted(tuple(row) for row in rows)))
    return out


@pytest.mark.parametrize(("speeds", "pp", "dp"), [
    ((), 3, 2), ((0.5,), 1, 3), ((0.5,), 3, 2), ((0.3, 0.9), 3, 2), ((0.3, 0.3), 2, 2), ((0.4, 0.6), 4, 1),
    ((0.3, 0.5, 0.9), 2, 3), ((0.5, 0.5, 0.7), 3, 2),
])
def test_every_placement_once(speeds, pp, dp):
    found = all_placements(speeds, pp, dp)
    assert len(found) == len(set(found))
    assert {tuple(sorted(p.rows)) for p in found} == _brute_placements(speeds, pp, dp)
    assert all(len(p.rows) == dp and all(len(row) == pp for row in p.rows) for p in found)


def test_beyond_the_limit_packed_and_spread_are_tried():
    speeds = (0.3, 0.4, 0.5, 0.6)
    found, complete = placements(speeds, 8, 8, limit=10)
    assert not complete
    assert set(found) == {packed(speeds, 8, 8), spread(speeds, 8, 8)}
    assert packed(speeds, 8, 8).slow_rows == ((1.0, 0.3, 0.4, 0.5, 0.6, 1.0, 1.0, 1.0),)
    assert len(spread(speeds, 8, 8).slow_rows) == 4


def _runs_ok(grid, tp: int) -> bool:
    """Whether every node's cells are one run in tp-dp-pp order and every group sits in one node."""
    order = [grid[r][s] for s in range(len(grid[0])) for r in range(len(grid))]
    nodes = [slot.node for slot in order]
    runs = [node for i, node in enumerate(nodes) if i == 0 or nodes[i - 1] != node]
    return len(runs) == len(set(runs)) and all(len(slot.devices) == tp for slot in order)


def _brute_launchable(cluster, tp: int, pp: int, dp: int, placement: Placement) -> bool:
    """Some replica order, node order and run lengths serve every cell from its run's node: full cells
    by a full-speed group, degraded cells by a group of that speed (groups as the inventory forms them)."""
    groups = {}
    for node in range(cluster.num_nodes):
        gpus = sorted(((g, cluster.speed_of(node, g)) for g in range(cluster.gpus_per_node)
                       if (node, g) not in cluster.failed), key=lambda item: (-item[1], item[0]))
        blocks = [gpus[i:i + tp] for i in range(0, len(gpus) - tp + 1, tp)]
        groups[node] = sorted(min(speed for _, speed in block) for block in blocks)
    cells = pp * dp
    for rows in set(itertools.permutations(placement.rows)):
        needs = [rows[r][s] for s in range(pp) for r in range(dp)]
        for order in itertools.permutations(range(cluster.num_nodes)):
            for lengths in itertools.product(range(cells + 1), repeat=len(order)):
                if sum(lengths) != cells:
                    continue
                start, ok = 0, True
                for node, length in zip(order, lengths):
                    have = list(groups[node])
                    for need in needs[start:start + length]:
                        match = next((i for i, speed in enumerate(have) if (speed >= 1.0) == (need >= 1.0)
                                      and (need >= 1.0 or speed == need)), None)
                        if match is None:
                            ok = False
                            break
                        have.pop(match)
                    start += length
                    if not ok:
                        break
                if ok:
                    return True
    return False


@pytest.mark.parametrize(("nodes", "gpus", "tp", "failed", "slow"), [
    (2, 4, 1, (), (("1:0", 0.5),)),
    (2, 4, 1, (), (("0:0", 0.5), ("1:3", 0.6))),
    (2, 4, 2, ("0:1",), (("1:2", 0.7),)),
    (3, 2, 1, (), (("0:0", 0.5), ("2:1", 0.5))),
    (3, 4, 2, ("1:0",), (("0:0", 0.4), ("0:1", 0.8))),
])
def test_launch_grid_is_valid_and_found_exactly_when_one_exists(nodes, gpus, tp, failed, slow):
    cluster = build_cluster_state(nodes, gpus, list(failed), list(slow))
    inventory = slot_inventory(cluster, tp)
    checked = launchable = 0
    for pp in range(1, 5):
        for dp in range(1, inventory.total // pp + 1):
            speeds = degraded_speeds_used(inventory, pp, dp)
            for placement in all_placements(speeds, pp, dp):
                grid = launch_grid(cluster, tp, pp, dp, placement)
                expected = _brute_launchable(cluster, tp, pp, dp, placement)
                assert (grid is not None) == expected, (pp, dp, placement)
                if grid is not None:
                    launchable += 1
                    assert _runs_ok(grid, tp)
                    assert sorted(tuple(slot.speed for slot in row) for row in grid) == sorted(placement.rows)
                    used = [(slot.node, g) for row in grid for slot in row for g in slot.devices]
                    assert len(used) == len(set(used)) and not set(used) & cluster.failed
                checked += 1
    assert launchable > 0 and checked >= 5


def test_two_slow_groups_on_two_nodes_in_one_replica_of_a_full_cluster_cannot_launch():
    """2 nodes x 4 GPUs, tp 1, pp 2, dp 4: ranks 0-3 are stage 0, 4-7 stage 1, one node each; both slow
    GPUs in stage 0 would need them in one node. One in stage 0 and one in stage 1 launches."""
    cluster = build_cluster_state(2, 4, [], [("0:0", 0.5), ("1:0", 0.6)])
    both_first_stage = Placement(((0.5, 1.0), (0.6, 1.0)), 2, 2)
    assert launch_grid(cluster, 1, 2, 4, both_first_stage) is None
    one_each = Placement(((0.5, 1.0), (1.0, 0.6)), 2, 2)
    assert launch_grid(cluster, 1, 2, 4, one_each) is not None
