"""Baselines on a small damaged cluster: they run, resiplan is never worse, and the special cases hold."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.baselines import BASELINES
from benchmarks.baselines.common import (
    allocate_microbatches,
    healthy_plan,
    without_failures,
)
from benchmarks.baselines.resihp import shrink_group
from cost_models.pipeline import pipeline_time_ms
from planner.plan import plan
from planner.problem import ClusterState
from tests.planner.helpers import small_problem

GPUS_PER_NODE = 4
# Plans report iteration times rounded to 1e-3 ms; allow that on top of the relative tolerance.
ROUNDING_MS = 5e-4


def _close_or_below(value: float, reference: float) -> bool:
    return value <= reference * (1 + 1e-6) + ROUNDING_MS


@pytest.fixture(scope="module")
def problem():
    return small_problem(num_nodes=4, gpus_per_node=GPUS_PER_NODE, failed=("1:2",), slow=(("2:1", 0.5),), global_batch=16)


@pytest.fixture(scope="module")
def healthy(problem):
    return healthy_plan(problem)


@pytest.fixture(scope="module")
def results(problem, healthy):
    return {name: baseline(problem, healthy) for name, baseline in BASELINES.items()}


def test_every_baseline_returns_a_positive_iteration_time(results):
    assert set(results) == {"cordon", "resihp", "oobleck", "recycle"}
    for name, result in results.items():
        assert result.name == name
        assert result.iteration_ms > 0
        assert result.tokens_per_s > 0
        assert result.gpus_used > 0


def test_resiplan_is_never_slower_than_a_baseline(problem, results):
    ours = plan(problem).solver.objective_ms
    for name, result in results.items():
        assert _close_or_below(ours, result.iteration_ms), (name, ours, result.iteration_ms)


def test_cordon_uses_no_gpu_of_a_damaged_node(problem, results):
    healthy_nodes = problem.cluster.num_nodes - len(problem.cluster.damaged_nodes)
    assert results["cordon"].gpus_used <= healthy_nodes * GPUS_PER_NODE


def test_recycle_and_resihp_without_failures_equal_the_healthy_plan(problem, healthy):
    intact = without_failures(problem)
    expected = healthy.solver.objective_ms
    for name in ("recycle", "resihp"):
        value = BASELINES[name](intact, healthy).iteration_ms
        assert value == pytest.approx(expected, rel=1e-6, abs=ROUNDING_MS), name


def test_baselines_without_healthy_plan_compute_it(problem, results):
    assert BASELINES["recycle"](problem).iteration_ms == pytest.approx(results["recycle"].iteration_ms)


def test_microbatch_allocation_is_min_max_optimal():
    stage_ms = [(3.0, 5.0), (4.0, 4.0, 1.0), (12.0,)]
    total = 9
    counts = allocate_microbatches(stage_ms, total, 1)
    assert sum(counts) == total
    value = max(pipeline_time_ms(t, m) for t, m in zip(stage_ms, counts) if m)
    best = min(
        max(pipeline_time_ms(t, m) for t, m in zip(stage_ms, split) if m)
        for split in itertools.product(range(total + 1), repeat=3)
        if sum(split) == total
    )
    assert value == pytest.approx(best)


def test_resihp_tp_shrink_keeps_the_best_power_of_two_subset():
    cluster = ClusterState(1, 8, frozenset({(0, 0)}), (((0, 1), 0.5), ((0, 2), 0.25)))
    group = tuple((0, g) for g in range(8))
    sizes = [1, 2, 4, 8]
    # 7 alive: k = 4 at speed 1 (4.0) beats k = 2 (2.0); k = 8 is too big.
    assert shrink_group(cluster, group, sizes).tp == 4
    half = ClusterState(1, 4, frozenset(), (((0, 3), 0.5),))
    # 4 x 0.5 ties 2 x 1.0: the larger k wins, at the slow GPU's speed.
    shrunk = shrink_group(half, tuple((0, g) for g in range(4)), sizes)
    assert (shrunk.tp, shrunk.speed) == (4, 0.5)
    dead = ClusterState(1, 2, frozenset({(0, 0), (0, 1)}))
    assert shrink_group(dead, ((0, 0), (0, 1)), sizes) is None
