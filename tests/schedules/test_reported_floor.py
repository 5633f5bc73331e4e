"""`reported_floor_ms` must lie below whatever `with_schedules` reports for a layout, CP-SAT's own order included:
`planner.plan` skips scheduling a runner-up whose floor is not below the answer, so a floor above a reachable time
would drop a faster answer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.assemble import assemble_plan
from planner.budget import Budget
from planner.plan import _stock_layout
from planner.schedules.for_plan import handcrafted_reported_ms, reported_floor_ms, with_schedules
from planner.uniform.search import search
from tests.planner.helpers import small_problem
from wire.convert import to_problem
from wire.schemas import PlanRequest

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


def test_the_floor_leaves_out_the_sync_looped_bfs_can_hide() -> None:
    """32 H100 on 50 Gb/s NICs, llama3-8b, batch 16 x 4,096, looped BFS only: the stock layout (tp 2, pp 2, 8 chunks
    per stage, 8 replicas) hides most of its gradient sync under the backward of earlier chunks, so it reports 377.6 ms
    where its makespan bound plus its whole priced sync is 452.1 ms. A floor that kept the sync would rule out a
    layout that can win."""
    body = {"cluster": {"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM", "inter_node_bandwidth_gb_s": 6.25},
            "model": "llama3-8b", "training": {"global_batch_size": 16, "seq_length": 4096},
            "options": {"allow_non_uniform": False, "schedules": ["looped-bfs"]}}
    problem = to_problem(PlanRequest.model_validate(body))
    layout = _stock_layout(problem, Budget.starting_now(30))
    scheduled_ms = with_schedules(problem, layout, Budget.starting_now(30)).predicted.iteration_time_s * 1e3
    assert layout.virtual_stages > 1
    assert reported_floor_ms(problem, layout) <= scheduled_ms * (1 + 1e-9)
    # The same layout where no allowed schedule hides sync: the floor keeps it, and sits above what looped BFS runs.
    keeping_sync_ms = reported_floor_ms(replace(problem, schedules=frozenset({"interleaved"})), layout)
    assert keeping_sync_ms > scheduled_ms, (keeping_sync_ms, scheduled_ms)
