"""Under CPU load every bisection probe of the allocation can time out; the plan must still come back.

A probe that runs out of time reads as infeasible, which once pushed the
bisection past the top budget (already solved and feasible) and crashed with
an IndexError: a 500 to the client.
"""

from __future__ import annotations

import planner.allocation as allocation
from api.schemas import PlanRequest
from api.service import plan_for
from tests.api.support import small_request, verify_plan


def test_plan_survives_every_feasibility_probe_timing_out(monkeypatch):
    monkeypatch.setattr(allocation, "_feasible", lambda *args, **kwargs: False)
    body = small_request(failures={"failed": ["0:3"], "slow": [{"device": "1:1", "speed": 0.5}]})
    plan = plan_for(PlanRequest.model_validate(body))
    verify_plan(plan.model_dump(mode="json"), body)
