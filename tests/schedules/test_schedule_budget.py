"""The schedule step inside the time limit: what it simulates with no time left, and how long it gets."""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from planner.assemble import assemble_plan
from planner.budget import Budget
from planner.config import DEFAULT_CONFIG
from planner.plan import (
    plan,
    schedule_budget_s,
    schedule_time_s,
)
from planner.schedules.for_plan import (
    SHARED_TIMELINES_NOTE,
    _handcrafted_within,
    first_choice,
    with_schedules,
)
from planner.schedules.handcrafted import handcrafted_schedules
from planner.schedules.ops import ChunkTimes, PipelineSpec
from planner.schedules.simulator import simulate
from planner.uniform.search import search
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
    runs = _handcrafted_within(specs, None, Budget(time.monotonic() - 1.0))
    assert {key: [s.name for s, _ in items] for key, items in runs.items()} == {"slow": ["1f1b"], "fast": ["1f1b"]}
    # 1F1B on equal stages meets (m + p - 1)(F + B): 11 x 3.5 ms for the fast replica.
    assert math.isclose(runs["fast"][0][1].makespan_ms, 11 * 3.5)


def test_with_time_every_allowed_handcrafted_schedule_is_simulated():
    specs = {"only": spec(3, 6)}
    runs = _handcrafted_within(specs, None, Budget.unlimited())
    assert sorted(s.name for s, _ in runs["only"]) == sorted(ALL_HANDCRAFTED)
    restricted = _handcrafted_within(specs, {"zb-h1", "gpipe"}, Budget.unlimited())
    assert [s.name for s, _ in restricted["only"]] == ["zb-h1", "gpipe"]


def test_schedule_time_is_the_budget_normally_and_never_past_the_limit():
    assert schedule_budget_s(10.0) == 1.0
    # A search that used 2 s of 10 leaves 8: the schedule step still gets its 1 s budget.
    assert schedule_time_s(10.0, left_s=8.0) == 1.0
    # A search that finished early leaves more than the 0.1 s budget of a 1 s answer: list schedules may use it ...
    assert schedule_time_s(1.0, left_s=0.4) == 0.4
    # ... up to one CP-SAT schedule's cap, and never past the limit.
    assert schedule_time_s(60.0, left_s=30.0) == DEFAULT_CONFIG.max_optimize_s_per_replica
    assert schedule_time_s(1.0, left_s=0.05) == 0.05
    assert schedule_time_s(1.0, left_s=-0.2) == 0.0


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


def _layout_with_two_replicas(slow_stage_of_second: int, slower_first_stage: int | None = None):
    """A 1F1B-only problem and a pre-schedule layout of two replicas alike but for their stages'
    speeds: the second replica's stage `slow_stage_of_second` takes 1.5x longer; with
    `slower_first_stage`, the first replica's stage of that index takes 1.3x longer."""
    problem = replace(small_problem(num_nodes=4, gpus_per_node=1), schedules=frozenset({"1f1b"}))
    layout = assemble_plan(problem, search(problem))
    first = layout.replicas[0]
    assert len(first.stages) > 1, "the case needs pipelines"

    def slowed(replica, index: int, factor: float, replica_id: int):
        stages = tuple(
            replace(stage, forward_ms=stage.forward_ms * factor, backward_ms=stage.backward_ms * factor,
                    weight_grad_ms=stage.weight_grad_ms * factor) if i == index else stage
            for i, stage in enumerate(replica.stages)
        )
        return replace(replica, id=replica_id, stages=stages)

    one = first if slower_first_stage is None else slowed(first, slower_first_stage, 1.3, 0)
    two = slowed(first, slow_stage_of_second, 1.5, 1)
    return problem, replace(layout, replicas=(replace(one, id=0), two))


def _exact_makespans(problem, layout):
    exact = with_schedules(problem, layout, Budget.unlimited())
    return exact, {ids: t.simulation.makespan_ms for t in exact.pipeline_schedule.replicas for ids in t.replica_ids}


def test_without_time_for_every_timeline_replicas_alike_but_for_speed_share_the_slower_ones():
    problem, layout = _layout_with_two_replicas(slow_stage_of_second=1)
    exact, makespans = _exact_makespans(problem, layout)
    assert len(exact.pipeline_schedule.replicas) == 2
    shared = with_schedules(problem, layout, Budget(time.monotonic() - 1.0))
    [timeline] = shared.pipeline_schedule.replicas
    assert sorted(timeline.replica_ids) == [0, 1]
    # The second replica is slower at every op, so the shared timeline is exactly its own.
    assert math.isclose(timeline.simulation.makespan_ms, makespans[1])
    assert math.isclose(shared.predicted.iteration_time_s, exact.predicted.iteration_time_s)
    # Activation peaks depend on the order alone: every stage's memory is what its exact timeline gives.
    assert [[s.memory_gib for s in r.stages] for r in shared.replicas] == [
        [s.memory_gib for s in r.stages] for r in exact.replicas]
    assert shared.solver.status == "FEASIBLE" and shared.status == "feasible"
    assert SHARED_TIMELINES_NOTE in shared.solver.notes
    # With no time at all even the one timeline left is late, and the plan says so.
    assert any("past its time limit" in note for note in shared.solver.notes), shared.solver.notes


def test_a_shared_envelope_timeline_bounds_every_member_it_stands_for():
    # Neither replica is slower everywhere: the envelope is slower than both.
    problem, layout = _layout_with_two_replicas(slow_stage_of_second=1, slower_first_stage=0)
    exact, makespans = _exact_makespans(problem, layout)
    shared = with_schedules(problem, layout, Budget(time.monotonic() - 1.0))
    [timeline] = shared.pipeline_schedule.replicas
    assert timeline.simulation.makespan_ms >= max(makespans.values()) - 1e-9
    assert shared.predicted.iteration_time_s >= exact.predicted.iteration_time_s - 1e-9


def test_with_time_for_them_replicas_keep_their_own_timelines():
    problem, layout = _layout_with_two_replicas(slow_stage_of_second=1)
    result = with_schedules(problem, layout, Budget(time.monotonic() + 60.0), optional_s=0.0)
    assert len(result.pipeline_schedule.replicas) == 2
    assert result.solver.notes == ()


@given(
    stages=st.integers(2, 5), microbatches=st.integers(1, 9), seed=st.integers(0, 10_000),
    factor=st.floats(1.0, 3.0), which=st.integers(0, 4),
)
def test_in_a_fixed_order_a_longer_op_never_ends_the_timeline_earlier(stages, microbatches, seed, factor, which):
    """What shared envelope timelines rest on: for every handcrafted order, slowing one stage never
    shortens the makespan, and the activation peaks do not move."""
    rng = random.Random(seed)
    times = [ChunkTimes(rng.uniform(0.5, 2), rng.uniform(0.5, 2), rng.uniform(0.1, 1), 0.1) for _ in range(stages)]
    slowed = list(times)
    k = which % stages
    slowed[k] = ChunkTimes(times[k].forward_ms * factor, times[k].input_grad_ms * factor,
                           times[k].weight_grad_ms * factor, times[k].activation_gib)
    base = PipelineSpec(tuple((t,) for t in times), microbatches)
    slow = PipelineSpec(tuple((t,) for t in slowed), microbatches)
    for schedule in handcrafted_schedules(base):
        before, after = simulate(schedule, base), simulate(schedule, slow)
        assert after.makespan_ms >= before.makespan_ms - 1e-9, schedule.name
        assert after.peak_activation_gib == before.peak_activation_gib, schedule.name
