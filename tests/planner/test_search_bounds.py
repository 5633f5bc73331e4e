"""The failure-aware search prunes with bounds and shortcuts; each must never cut off the optimum.

Checked against what they bound, computed the slow way: the exact split
search against sorting every candidate bottleneck, and the allocation's LP
bound against the allocation it then finds.
"""

from __future__ import annotations

import bisect
import random

import pytest

from planner.budget import Budget
from planner.nonuniform.allocation.search import AllocationInput, AllocationSearch
from planner.nonuniform.outer_bounds import build_inventory
from planner.nonuniform.search import (
    _link_replicas,
    _memory_replicas,
    outer_choices,
)
from planner.nonuniform.layer_splits import best_split, split_within
from planner.nonuniform.templates import (
    TermsCache,
    enumerate_templates,
    pipeline_lengths,
)
from planner.uniform.candidates import tensor_parallel_sizes
from tests.planner.helpers import small_problem
from tests.planner.test_nonuniform_brute_force import CASES


def _outer_choices_with_templates(problem):
    sizes = tensor_parallel_sizes(problem)
    shared: dict = {}
    for outer in outer_choices(problem):
        inventory = build_inventory(problem, outer.tp, sizes, outer.cp)
        if pipeline_lengths(outer.pp)[0] > inventory.group_count_bound():
            continue
        memory, links = _memory_replicas(problem, outer, inventory), _link_replicas(outer, inventory, problem.config)
        cache = TermsCache(problem, outer, memory, links, shared)
        templates = enumerate_templates(problem, outer, cache, inventory.degraded_types(), links)
        if templates:
            yield outer, inventory, memory, templates


def _split_by_sorting(per_layer, fixed, caps, layers, unit):
    """Every candidate bottleneck sorted, the least that holds all units: the obvious algorithm."""
    units = layers // unit
    stages = len(per_layer)
    unit_caps = [min(c // unit, units) for c in caps]
    if layers % unit or units < stages or min(unit_caps) < 1 or sum(unit_caps) < units:
        return None
    per_unit = [a * unit for a in per_layer]
    values = sorted({n * per_unit[i] + fixed[i] for i in range(stages) for n in range(1, unit_caps[i] + 1)})

    def held(bottleneck):
        total = 0
        for i in range(stages):
            most = min(unit_caps[i], int((bottleneck - fixed[i]) / per_unit[i] + 1e-9))
            if most < 1:
                return -1
            total += most
        return total

    index = bisect.bisect_left(range(len(values)), True, key=lambda k: held(values[k]) >= units)
    if index == len(values):
        return None
    return tuple(n * unit for n in split_within(values[index], per_unit, fixed, unit_caps, units))


def test_best_split_matches_sorting_every_candidate():
    rng = random.Random(7)
    for _ in range(3000):
        stages = rng.randint(1, 10)
        unit = rng.choice([1, 1, 2, 3])
        layers = unit * rng.randint(stages, 30)
        if rng.random() < 0.5:
            base = rng.uniform(1, 40)
            per_layer = [base * rng.choice([1, 1, 2, 1.25]) for _ in range(stages)]
            fixed = [float(rng.choice([0, 5, 10])) for _ in range(stages)]
        else:
            per_layer = [rng.uniform(0.5, 40) for _ in range(stages)]
            fixed = [rng.uniform(0, 80) for _ in range(stages)]
        caps = [rng.randint(0, layers + 3) for _ in range(stages)]
        assert best_split(per_layer, fixed, caps, layers, unit) == _split_by_sorting(per_layer, fixed, caps, layers, unit)


def _allocation_input(problem, outer, inventory, memory, templates) -> AllocationInput:
    return AllocationInput(
        templates=templates, base=inventory.base, healthy_base_groups=inventory.healthy_base_groups,
        classes=list(inventory.classes), partitions=[list(p) for p in inventory.partitions],
        microbatches=problem.workload.global_batch_size // outer.micro_batch_size,
        virtual_stages=outer.virtual_stages, min_replicas=memory,
    )


@pytest.mark.parametrize("case", list(CASES.values())[:3], ids=list(CASES.keys())[:3])
def test_allocation_bound_is_below_the_allocation_found(case):
    problem = small_problem(**case)
    checked = 0
    for outer, inventory, memory, templates in _outer_choices_with_templates(problem):
        search = AllocationSearch(_allocation_input(problem, outer, inventory, memory, templates), random_seed=0)
        bound = search.front_ms()
        found = search.solve(Budget.starting_now(30.0))
        if found is None:
            assert bound == float("inf") or search.front_ms() == float("inf")
            continue
        assert found.optimal
        assert bound <= found.objective_ms * (1 + 1e-9)
        checked += 1
    assert checked


def test_allocation_search_refines_one_set_at_a_time():
    problem = small_problem(num_nodes=3, failed=("0:0",), slow=(("2:3", 0.25),))
    outer, inventory, memory, templates = next(iter(_outer_choices_with_templates(problem)))
    data = _allocation_input(problem, outer, inventory, memory, templates)
    stepped = AllocationSearch(data, random_seed=0)
    budget = Budget.starting_now(30)
    fronts = []
    while (front := stepped.front_ms()) < float("inf"):
        fronts.append(front)
        stepped.advance(budget)
    # The bound only rises, and stepping ends where solving in one call does.
    assert fronts == sorted(fronts)
    once = AllocationSearch(data, random_seed=0).solve(Budget.starting_now(30.0))
    assert (once is None) == (stepped.allocation() is None)
    if once is not None:
        assert stepped.allocation().objective_ms == pytest.approx(once.objective_ms)
