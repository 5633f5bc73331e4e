"""What an oracle test asserts of the plans of one request, given the oracle's optimum of the stock space."""

from __future__ import annotations

import pytest

from api.tasks.planning import plan_for
from planner.errors import PlanningError
from wire.schemas import Plan, PlanRequest

TOLERANCE = 1e-3  # the figures' rounding


def check_plans_against(body: dict, best_s: float, layout: dict | None) -> Plan | None:
    """The stock plan of `body` is the oracle's optimum `best_s` (found with `layout`), proven, its solver
    report in the number it reports; the failure-aware plan of the same request searches a space holding
    every stock layout, so it is at least as fast and its bound does not exceed `best_s`. Where the oracle
    found nothing that fits, the planner must say so too, not invent a layout. The stock plan, if any."""
    request = PlanRequest.model_validate(body)
    if layout is None:
        with pytest.raises(PlanningError):
            plan_for(request)
        return None
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
    return plan
