"""The planner's optimum equals exhaustive enumeration of the same search space.

The brute force enumerates shapes on its own (tp dividing heads and KV heads
within a node, every pp, dp, micro-batch size, recompute mode, schedule) and
every composition of the layers, and evaluates each with the cost model;
only the cost model and the slot-speed placement rule are shared.
"""

from __future__ import annotations

import itertools

import pytest

from cost_models.layout import ParallelShape
from cost_models.stage_costs import stage_cost_terms, stage_memory_bytes
from planner.devices import slot_inventory
from planner.errors import InfeasibleError
from planner.uniform.candidates import Candidate
from planner.uniform.search import evaluate, search
from tests.planner.helpers import small_problem


def compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def healthy_slot_count(problem, tp: int) -> int:
    cluster = problem.cluster
    count = 0
    for node in range(cluster.num_nodes):
        healthy = sum(1 for g in range(cluster.gpus_per_node) if (node, g) not in cluster.failed)
        count += healthy // tp
    return count


def brute_force_ms(problem) -> float:
    model = problem.workload.model
    layers, batch = model.num_layers, problem.workload.global_batch_size
    capacity = problem.usable_memory_bytes
    best = float("inf")
    for tp in range(1, problem.cluster.gpus_per_node + 1):
        if model.num_attention_heads % tp or model.num_kv_heads % tp:
            continue
        slots = healthy_slot_count(problem, tp)
        for mbs, dp, pp in itertools.product(problem.micro_batch_sizes, range(1, slots + 1), range(1, layers + 1)):
            if dp * pp > slots or batch % (dp * mbs):
                continue
            m = batch // (dp * mbs)
            schedules = [("1f1b", 1)] + [
                ("interleaved", v) for v in range(2, 9) if pp >= 2 and layers % (pp * v) == 0 and m % pp == 0
            ]
            for (schedule, v), recompute in itertools.product(schedules, problem.recompute_modes):
                shape = ParallelShape(tp, pp, dp, mbs, recompute, schedule, v)
                terms = stage_cost_terms(problem.workload, problem.hardware, shape, problem.efficiency, problem.software)
                candidate = Candidate(terms, slot_inventory(problem.cluster, tp), 0.0)
                for split in compositions(layers, pp):
                    if v > 1 and len(set(split)) != 1:
                        continue
                    if problem.stock_layouts_only and len(set(split[1:-1])) > 1:
                        continue
                    if any(stage_memory_bytes(terms, i, n) > capacity for i, n in enumerate(split)):
                        continue
                    best = min(best, evaluate(candidate, split).iteration_ms)
    return best


CASES = {
    "healthy 2x4": dict(),
    "one failed GPU": dict(failed=("0:1",)),
    "two failed, one whole node of 3": dict(num_nodes=3, failed=("1:*", "2:0")),
    "slow GPU": dict(slow=(("1:2", 0.5),)),
    "failed and slow": dict(num_nodes=3, failed=("0:0",), slow=(("2:3", 0.25),)),
    "stock layouts only": dict(num_nodes=4, gpus_per_node=2, stock_layouts_only=True),
    "4x4 batch 16, zero 0": dict(num_nodes=4, gpus_per_node=4, global_batch=16, zero_stage=0),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_planner_matches_brute_force(case):
    problem = small_problem(**case)
    expected = brute_force_ms(problem)
    found = search(problem)
    assert found.optimal
    assert found.gap == 0.0
    # CP-SAT works on 1 us ticks; allow that rounding, nothing more.
    assert found.objective_ms == pytest.approx(expected, rel=1e-5, abs=1e-3)


def test_memory_actually_binds_in_these_cases():
    """Guard for the cases above: the tiny model does not fit unsharded on one small GPU."""
    problem = small_problem(num_nodes=1, gpus_per_node=1)
    with pytest.raises(InfeasibleError):
        search(problem)


def test_failed_devices_reduce_slots():
    problem = small_problem(failed=("0:1",))
    # Node 0 keeps 3 healthy GPUs: one TP group of 2, three of 1.
    assert slot_inventory(problem.cluster, 2).total == 1 + 2
    assert slot_inventory(problem.cluster, 1).total == 3 + 4
