"""The stock uniform planner against the exhaustive oracle, on 60 small instances.

`tests/oracle/enumerator.py` estimates every layout of the space `allow_non_uniform: false` declares
through `/v1/estimate`; the plan must be that optimum (within 0.1%, the figures' rounding), proven
optimal, and its solver report must be in the number it reports: objective = 1000 x the predicted
iteration time, the bound at most that. Mutation runs that made this fail are in BENCHMARKS.md
("Uniform plans against an exhaustive oracle").

The failure-aware plan of the same request (`allow_non_uniform: true`) searches a space that holds every
stock layout, so it must be at least as fast as the oracle's optimum, and its bound (on every layout of
that space) must not exceed it.
"""

from __future__ import annotations

import random

import pytest

from api.tasks.planning import plan_for
from planner.errors import PlanningError
from tests.oracle.enumerator import instance, oracle_best
from wire.schemas import PlanRequest

INSTANCES = 60
SEED = 16
TOLERANCE = 1e-3


def _instances() -> list[dict]:
    rng = random.Random(SEED)
    return [instance(rng) for _ in range(INSTANCES)]


@pytest.mark.parametrize("body", _instances(), ids=[f"instance-{i}" for i in range(INSTANCES)])
def test_the_stock_plan_is_the_oracles_optimum(body: dict) -> None:
    best_s, layout = oracle_best(body)
    request = PlanRequest.model_validate(body)
    if layout is None:  # nothing fits (a small GPU): the planner must say so too, not invent a layout
        with pytest.raises(PlanningError):
            plan_for(request)
        return
    plan = plan_for(request)
    predicted_s = plan.predicted.iteration_time_s
    assert predicted_s == pytest.approx(best_s, rel=TOLERANCE), (
        f"plan {predicted_s} s vs the oracle's {best_s} s with {layout}")
    assert plan.solver.status == "OPTIMAL"
    assert plan.solver.objective_ms == pytest.approx(1e3 * predicted_s, rel=5e-3)
    assert plan.solver.bound_ms <= 1e3 * predicted_s * (1 + 1e-6)

    failure_aware = plan_for(PlanRequest.model_validate({**body, "options": {**body["options"], "allow_non_uniform": True}}))
    fa_s = failure_aware.predicted.iteration_time_s
    assert fa_s <= best_s * (1 + TOLERANCE), f"failure-aware plan {fa_s} s, slower than the stock layout {layout} at {best_s} s"
    assert failure_aware.solver.objective_ms == pytest.approx(1e3 * fa_s, rel=5e-3)
    assert failure_aware.solver.bound_ms <= 1e3 * best_s * (1 + 1e-6), "the bound excludes a layout the oracle found"
