"""Every phase keeps the answer's deadline: given no time, each degrades, and the answer is still a valid
plan whose bound is honest (never above the true optimum).

No test here measures time: "no time" is a Budget whose deadline has passed, and what is asserted is
what the planner did with it.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from api.tasks.planning import plan_for
from planner.assemble import assemble_plan
from planner.budget import Budget
from planner.deadline import least_time_limit_s
from planner.schedules.for_plan import with_schedules
from planner.uniform.candidates import ranked_candidates, uniform_floor_ms
from planner.uniform.search import UniformSearch, search
from tests.api.support import small_request, verify_plan
from tests.planner.helpers import small_problem
from tests.planner.test_brute_force import CASES, brute_force_ms
from wire.convert import to_problem
from wire.schemas import PlanRequest

DAMAGED = {"failures": {"failed": ["0:3"], "slow": [{"device": "1:1", "speed": 0.5}, {"device": "1:6", "speed": 0.7}]}}


def past() -> Budget:
    return Budget(time.monotonic() - 1.0)


def test_a_budget_shares_what_is_left_and_never_runs_past_its_deadline():
    budget = Budget(time.monotonic() + 100.0)
    quarter = budget.share(0.25)
    assert quarter.deadline_s < budget.deadline_s
    assert 24.0 < quarter.remaining_s() <= 25.0
    assert budget.share(3.0).deadline_s <= budget.deadline_s
    assert budget.less(30.0).deadline_s == budget.deadline_s - 30.0
    assert budget.capped(1.0).remaining_s() <= 1.0
    assert budget.capped(1e6).deadline_s == budget.deadline_s
    assert past().expired() and past().remaining_s() == 0.0
    assert not Budget.unlimited().expired()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_uniform_floor_is_below_every_shape_and_the_optimum(case):
    """What bounds the shapes a deadline left uncosted is a bound: below every costed shape's own bound
    and below the exhaustive optimum."""
    problem = small_problem(**case)
    candidates, complete = ranked_candidates(problem)
    assert complete
    floor = uniform_floor_ms(problem)
    assert 0 < floor <= min(c.lower_bound_ms for c in candidates) * (1 + 1e-9)
    assert floor <= brute_force_ms(problem)


def test_costing_shapes_stops_at_the_deadline_and_the_search_says_it_is_unfinished():
    problem = small_problem(num_nodes=16, gpus_per_node=8, global_batch=256)
    everything, complete = ranked_candidates(problem, Budget.unlimited())
    cut, cut_complete = ranked_candidates(problem, past())
    assert complete and not cut_complete
    assert 0 < len(cut) < len(everything)
    found = UniformSearch(problem, past()).result()
    assert found is not None and not found.optimal
    assert found.bound_ms <= uniform_floor_ms(problem)


@pytest.mark.parametrize("name", ["one failed GPU", "failed and slow", "4x4 batch 16, zero 0"])
def test_a_search_given_no_time_still_has_a_layout_and_an_honest_bound(name):
    problem = small_problem(**CASES[name])
    optimum = brute_force_ms(problem)
    found = search(problem, past())
    assert found.objective_ms >= optimum * (1 - 1e-5)
    assert found.bound_ms <= optimum * (1 + 1e-5)
    if found.objective_ms > optimum * (1 + 1e-5):
        assert not found.optimal and found.gap > 0


def test_a_plan_whose_deadline_passed_in_the_queue_is_valid_bounded_and_says_why_it_was_late():
    body = small_request(**DAMAGED)
    request = PlanRequest.model_validate(body)
    unhurried = plan_for(PlanRequest.model_validate({**body, "options": {"time_limit_s": 30}}))
    late = plan_for(request, 60.0, Budget(time.monotonic() - 5.0))
    verify_plan(late.model_dump(mode="json"), body)
    assert any("were left when the planner started" in note for note in late.solver.notes), late.solver.notes
    # The layout is at best the optimum, and the bound it reports is no more than the optimum.
    assert late.solver.objective_ms >= unhurried.solver.objective_ms * (1 - 1e-6)
    assert late.solver.bound_ms <= unhurried.solver.objective_ms * (1 + 1e-6)


def test_a_limit_below_the_least_an_answer_takes_is_raised_and_the_answer_says_so():
    body = small_request(**DAMAGED, options={"time_limit_s": 0.001})
    request = PlanRequest.model_validate(body)
    plan = plan_for(request)
    verify_plan(plan.model_dump(mode="json"), body)
    least = least_time_limit_s(to_problem(request))
    assert plan.solver.time_limit_s == pytest.approx(least, abs=1e-3)
    assert any(f"raised to {least:.3g} s" in note for note in plan.solver.notes), plan.solver.notes


def test_the_answer_reports_the_limit_it_was_computed_under():
    request = PlanRequest.model_validate(small_request(options={"time_limit_s": 5}))
    capped = plan_for(request, 2.0)
    assert capped.solver.time_limit_s == 2.0
    assert capped.solver.notes == []
    assert plan_for(request).solver.time_limit_s == 5.0


def test_the_least_time_limit_grows_with_the_cluster_and_its_damage():
    small = to_problem(PlanRequest.model_validate(small_request()))
    big = to_problem(PlanRequest.model_validate(small_request(cluster={"num_nodes": 2048, "gpus_per_node": 8,
                                                                       "gpu": "A100-80GB"})))
    slow = [{"device": f"{n}:{g}", "speed": 0.5} for n in range(1024) for g in range(8)]
    damaged = to_problem(PlanRequest.model_validate(small_request(
        cluster={"num_nodes": 2048, "gpus_per_node": 8, "gpu": "A100-80GB"}, failures={"slow": slow})))
    assert least_time_limit_s(small) < least_time_limit_s(big) < least_time_limit_s(damaged)


def test_the_search_counts_the_timeline_ops_its_best_layout_will_need():
    """The search stops early enough for its best layout's timelines; it counts them before they exist."""
    problem = replace(small_problem(num_nodes=4, gpus_per_node=2, slow=(("1:0", 0.5), ("3:1", 0.7)), global_batch=16),
                      schedules=frozenset({"1f1b"}))
    uniform = UniformSearch(problem)
    while uniform.next_bound_ms() < uniform.best_ms:
        uniform.step(Budget.unlimited())
    result = with_schedules(problem, assemble_plan(problem, uniform.result()), Budget.unlimited())
    simulated = sum(len(ops) for timeline in result.pipeline_schedule.replicas for ops in timeline.simulation.timelines)
    assert uniform.best_timeline_ops() == simulated
