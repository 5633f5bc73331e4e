"""`reported_floor_ms` must lie below whatever `with_schedules` reports for a layout, CP-SAT's own order included:
`planner.plan` skips scheduling a runner-up whose floor is not below the answer, so a floor above a reachable time
would drop a faster answer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.assemble import assemble_plan
from planner.budget import Budget
from planner.schedules.for_plan import handcrafted_reported_ms, reported_floor_ms, with_schedules
from planner.uniform.search import search
from tests.planner.helpers import small_problem

CASES = {
    "four single-GPU stages": dict(num_nodes=4, gpus_per_node=1, global_batch=8),
    "a slow GPU": dict(num_nodes=2, gpus_per_node=2, slow=(("1:1", 0.5),), global_batch=12),
    "a prime batch": dict(num_nodes=3, gpus_per_node=1, global_batch=7),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("schedules", [None, frozenset({"1f1b", "interleaved", "looped-bfs"})])
def test_no_schedule_reports_below_the_floor(case: str, schedules: frozenset[str] | None) -> None:
    problem = replace(small_problem(**CASES[case]), schedules=schedules)
    layout = assemble_plan(problem, search(problem))
    floor_ms = reported_floor_ms(problem, layout)
    scheduled_ms = with_schedules(problem, layout, Budget.starting_now(30)).predicted.iteration_time_s * 1e3
    assert floor_ms <= scheduled_ms * (1 + 1e-9), (floor_ms, scheduled_ms)
    assert floor_ms <= handcrafted_reported_ms(problem, layout) * (1 + 1e-9)
    # Not vacuous: the floor is the layout's time less at most its pipeline, never below its sync and step.
    assert floor_ms >= scheduled_ms - max(s.forward_ms + s.backward_ms for r in layout.replicas for s in r.stages) * max(
        r.num_microbatches for r in layout.replicas) - 1e-6
