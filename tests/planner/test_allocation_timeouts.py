"""Under CPU load every feasibility probe of the allocation can time out; the plan must still come back.

A probe that runs out of time is neither feasible nor infeasible: the
allocation keeps its bound and reports no optimum, and the plan falls back on
what the rest of the search found (once, a timed-out probe crashed the
bisection with an IndexError: a 500 to the client).
"""

from __future__ import annotations

from api.tasks.planning import plan_for
from planner.budget import Budget
from planner.nonuniform.allocation.model import UNKNOWN, FeasibilityModel
from planner.nonuniform.allocation.search import solve_allocation
from planner.nonuniform.search import search_nonuniform
from tests.api.support import small_request, verify_plan
from tests.planner.helpers import small_problem
from wire.schemas import PlanRequest


def test_plan_survives_every_feasibility_probe_timing_out(monkeypatch):
    monkeypatch.setattr(FeasibilityModel, "solve", lambda *args, **kwargs: UNKNOWN)
    body = small_request(failures={"failed": ["0:3"], "slow": [{"device": "1:1", "speed": 0.5}]})
    plan = plan_for(PlanRequest.model_validate(body))
    verify_plan(plan.model_dump(mode="json"), body)


def test_timed_out_probes_leave_the_search_unfinished(monkeypatch):
    probes = []

    def timed_out(*args, **kwargs):
        probes.append(1)
        return UNKNOWN

    monkeypatch.setattr(FeasibilityModel, "solve", timed_out)
    problem = small_problem(num_nodes=3, failed=("0:0",), slow=(("2:3", 0.25),))
    found = search_nonuniform(problem, float("inf"), Budget.starting_now(30))
    assert probes, "the case needs CP-SAT probes"
    assert not found.exhausted
    assert found.bound_ms < float("inf")
    if found.layout is not None:
        assert found.bound_ms <= found.layout.iteration_ms


def test_allocation_without_templates_is_none():
    from planner.nonuniform.allocation.search import AllocationInput
    from planner.nonuniform.partitions import StageType

    data = AllocationInput([], StageType(1, 1.0), 4, [], [], 8, 1, 1)
    assert solve_allocation(data, Budget.starting_now(1.0), 0) is None
