"""The stock search's bounds really are bounds on what plans report, and its splits are every stock split."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from planner.budget import Budget
from planner.uniform.candidates import simulation_floor_ms
from planner.uniform.simulated import StockSearch, stock_splits
from tests.planner.helpers import small_problem


@pytest.mark.parametrize(("layers", "pp", "caps"), [
    (6, 1, (6,)), (6, 2, (6, 6)), (7, 3, (7, 7, 7)), (9, 4, (3, 9, 9, 2)), (12, 5, (12, 2, 2, 2, 12)), (5, 5, (1,) * 5),
])
def test_stock_splits_are_every_split_with_equal_middle_stages_within_the_caps(layers, pp, caps):
    brute = {
        split for split in itertools.product(range(1, layers + 1), repeat=pp)
        if sum(split) == layers and len(set(split[1:-1])) <= 1 and all(n <= c for n, c in zip(split, caps))
    }
    found = list(stock_splits(layers, pp, caps, 1))
    assert len(found) == len(set(found))
    assert set(found) == brute


@pytest.mark.parametrize("schedules", [None, frozenset({"1f1b", "zb-h1", "zb-h2", "gpipe"})])
@pytest.mark.parametrize("case", [
    dict(num_nodes=1, gpus_per_node=4, global_batch=8),
    dict(num_nodes=2, gpus_per_node=4, global_batch=6, slow=(("0:1", 0.5),)),
    dict(num_nodes=1, gpus_per_node=8, global_batch=11, failed=("0:3",)),
])
def test_every_floor_and_split_bound_is_below_the_time_the_split_reports(case, schedules):
    """floor(shape), bound(split), bound(split) for placements not tried and bound(split, placement) are all
    at most the reported time(split, placement), for every shape, stock split and placement of the slow
    groups: the search prunes on these, so one bound above a reported time could cut the optimum away.
    (The floor may exceed a split's bound: that bound allows for rounding the floor does not need.)"""
    problem = small_problem(stock_layouts_only=True, **case)
    if schedules is not None:
        problem = replace(problem, schedules=schedules)
    search = StockSearch(problem, Budget.unlimited())
    layers = problem.workload.model.num_layers
    checked = 0
    for index, candidate in enumerate(search._candidates):
        floor = simulation_floor_ms(candidate, layers, full_backward=not search._split_backward)
        caps = candidate.max_layers(problem.usable_memory_bytes)
        placements, complete, _ = search._placements(index)
        assert complete
        for split in stock_splits(layers, candidate.shape.pp, caps, candidate.shape.virtual_stages):
            bound = search._split_bound(candidate, split)
            anywhere = search._anywhere_bound(candidate, split)  # what placements left untried keep
            for placement in placements:
                placed = search._placement_bound(candidate, split, placement)
                value = search._value(candidate, index, split, placement)
                for name, below in (("floor", floor), ("split", bound), ("anywhere", anywhere), ("placement", placed)):
                    assert below <= value * (1 + 1e-9), (name, candidate.shape, split, placement, below, value)
                checked += 1
    assert checked > 50
