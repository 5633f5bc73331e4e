"""The schedule step inside the time limit: what it simulates with no time left, and how long it gets."""

from __future__ import annotations

import math
import time
from dataclasses import replace

from planner.plan import MAX_OPTIMIZE_S_PER_REPLICA, plan, schedule_budget_s, schedule_time_s
from planner.schedules.for_plan import _handcrafted_within, first_choice
from planner.schedules.ops import ChunkTimes, PipelineSpec
from tests.planner.helpers import small_problem

ALL_HANDCRAFTED = ["gpipe", "1f1b", "zb-h1", "zb-h2"]


def spec(p: int, m: int, f: float = 1.0) -> PipelineSpec:
    return PipelineSpec(tuple((ChunkTimes(f, 2 * f, 0.5 * f),) for _ in range(p)), m)


def test_first_choice_is_1f1b_when_allowed_and_the_most_preferred_allowed_otherwise():
    assert first_choice(None, ALL_HANDCRAFTED) == "1f1b"
    assert first_choice({"gpipe", "zb-h2", "zb-h1"}, ALL_HANDCRAFTED) == "zb-h1"
    assert first_choice({"gpipe"}, ALL_HANDCRAFTED) == "gpipe"
    # Only CP-SAT allowed: the handcrafted seed is still the preferred one.
    assert first_choice({"optimized"}, ALL_HANDCRAFTED) == "1f1b"
    assert first_choice({"interleaved"}, ["interleaved"]) == "interleaved"


def test_past_the_deadline_each_replica_gets_only_its_first_choice():
    specs = {"slow": spec(4, 8, f=2.0), "fast": spec(4, 8)}
    runs = _handcrafted_within(specs, None, deadline=time.monotonic() - 1.0)
    assert {key: [s.name for s, _ in items] for key, items in runs.items()} == {"slow": ["1f1b"], "fast": ["1f1b"]}
    # 1F1B on equal stages meets (m + p - 1)(F + B): 11 x 3.5 ms for the fast replica.
    assert math.isclose(runs["fast"][0][1].makespan_ms, 11 * 3.5)


def test_with_time_every_allowed_handcrafted_schedule_is_simulated():
    specs = {"only": spec(3, 6)}
    runs = _handcrafted_within(specs, None, deadline=math.inf)
    assert sorted(s.name for s, _ in runs["only"]) == sorted(ALL_HANDCRAFTED)
    restricted = _handcrafted_within(specs, {"zb-h1", "gpipe"}, deadline=math.inf)
    assert [s.name for s, _ in restricted["only"]] == ["zb-h1", "gpipe"]


def test_schedule_time_is_the_budget_normally_and_never_past_the_limit():
    problem = replace(small_problem(), time_limit_s=10.0)
    assert schedule_budget_s(problem) == 1.0
    # A search that used 2 s of 10 leaves 8: the schedule step still gets its 1 s budget.
    assert schedule_time_s(problem, left_s=8.0) == 1.0
    short = replace(problem, time_limit_s=1.0)
    # A search that finished early leaves more than the 0.1 s budget: list schedules may use it ...
    assert schedule_time_s(short, left_s=0.4) == 0.4
    # ... up to one CP-SAT schedule's cap, and never past the limit.
    assert schedule_time_s(replace(problem, time_limit_s=60.0), left_s=30.0) == MAX_OPTIMIZE_S_PER_REPLICA
    assert schedule_time_s(short, left_s=0.05) == 0.05
    assert schedule_time_s(short, left_s=-0.2) == 0.0


def test_a_plan_with_no_time_left_still_has_a_simulated_timeline_per_replica():
    # One GPU per node and a model that does not fit one GPU: every replica is a pipeline.
    problem = replace(small_problem(num_nodes=4, gpus_per_node=1), time_limit_s=1e-9)
    result = plan(problem)
    assert max(len(r.stages) for r in result.replicas) > 1
    schedule = result.pipeline_schedule
    # One simulation only: the order the layout search priced (1F1B, interleaved for chunked stages).
    assert [name for name, _ in schedule.candidates_ms] == ["interleaved" if result.virtual_stages > 1 else "1f1b"]
    covered = sorted(rid for timeline in schedule.replicas for rid in timeline.replica_ids)
    assert covered == sorted(r.id for r in result.replicas)
    # The plan's iteration time is the slowest simulated timeline plus sync and step, as ever.
    assert result.predicted.iteration_time_s * 1e3 >= max(t.simulation.makespan_ms for t in schedule.replicas)
