"""Give a plan its schedules: one simulated timeline per distinct replica.

The layout search prices pipelines with the 1F1B bubble model; here every
distinct replica gets the fastest schedule that fits its memory, found by
simulation (and CP-SAT for the slowest replicas while time remains). The
plan's iteration time then moves by exactly what the slowest replica's
simulated makespan differs from the bubble model, so `predicted` and the
returned timelines are the same numbers, and each stage's `memory_gib`
becomes its static memory plus the chosen schedule's activation peak.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import replace

from cost_models.pipeline import pipeline_time_ms
from planner.assemble import predicted_figures
from planner.problem import PlanningProblem
from planner.result import PlanResult, ReplicaResult
from planner.schedules.bounds import lower_bound_ms
from planner.schedules.build import replica_spec, timeline_signature
from planner.schedules.choose import ChosenSchedule, choose_schedule, preference
from planner.schedules.handcrafted import handcrafted_schedules
from planner.schedules.ops import PipelineSpec, Schedule
from planner.schedules.optimal import OPTIMIZED
from planner.schedules.result import ReplicaTimeline, ScheduleChoice
from planner.schedules.simulator import SimulationResult, simulate

# A single replica's CP-SAT schedule gets at most this long, whatever the plan's budget.
MAX_OPTIMIZE_S_PER_REPLICA = 1.0
# Building the model alone takes a few tenths of a second at p = 9, m = 37: less time left is wasted.
MIN_OPTIMIZE_S = 0.25
# CP-SAT is worth its seconds only if it can shorten the iteration by more than this share.
MIN_ITERATION_GAIN = 5e-3


def with_schedules(problem: PlanningProblem, result: PlanResult, budget_s: float) -> PlanResult:
    started = time.monotonic()
    deadline = started + max(0.0, budget_s)
    allowed = problem.allowed_schedules
    gpu_memory_gib = problem.hardware.gpu.memory_gib
    groups: dict[tuple, list[ReplicaResult]] = {}
    for replica in result.replicas:
        groups.setdefault(timeline_signature(replica), []).append(replica)
    specs = {key: replica_spec(members[0], result.virtual_stages, gpu_memory_gib) for key, members in groups.items()}
    handcrafted = _handcrafted_within(specs, allowed, deadline)
    min_gain_ms = MIN_ITERATION_GAIN * result.predicted.iteration_time_s * 1e3
    chosen = {key: choose_schedule(spec, allowed=allowed, simulated=handcrafted[key]) for key, spec in specs.items()}
    # Greedy list schedules first, for the slowest replica again and again (the plan waits only for
    # it): milliseconds each, and often at the lower bound already, so CP-SAT has less left to gain.
    # On long pipelines (p = 32, m = 128) they take tenths of a second: only while the budget lasts.
    listed: set[tuple] = set()
    while (
        (slowest := max(chosen, key=lambda key: chosen[key].simulation.makespan_ms)) not in listed
        and time.monotonic() < deadline
    ):
        listed.add(slowest)
        chosen[slowest] = choose_schedule(
            specs[slowest], allowed=allowed, optimize_time_limit_s=MIN_OPTIMIZE_S, min_gain_ms=min_gain_ms,
            seed=problem.random_seed, simulated=handcrafted[slowest], use_solver=False,
        )
    bounds = {key: lower_bound_ms(spec) for key, spec in specs.items()}

    # CP-SAT only pays where it lowers the iteration: on the slowest replica, again and again, while
    # the plan's pipeline is more than the gain threshold above what every replica's bound allows.
    optimized: set[tuple] = set()
    while (remaining := deadline - time.monotonic()) > MIN_OPTIMIZE_S:
        slowest = max(chosen, key=lambda key: chosen[key].simulation.makespan_ms)
        if slowest in optimized or chosen[slowest].simulation.makespan_ms - max(bounds.values()) <= min_gain_ms:
            break
        optimized.add(slowest)
        current = chosen[slowest].schedule
        chosen[slowest] = choose_schedule(
            specs[slowest], allowed=allowed, optimize_time_limit_s=min(remaining, MAX_OPTIMIZE_S_PER_REPLICA),
            min_gain_ms=min_gain_ms, seed=problem.random_seed, simulated=handcrafted[slowest],
            start=current if current.name == OPTIMIZED else None,
        )
    scheduled = _apply(problem, result, groups, chosen)
    # The solver's wall time covers the whole answer: layout search and schedules.
    wall_time_s = round(result.solver.wall_time_s + time.monotonic() - started, 3)
    return replace(scheduled, solver=replace(scheduled.solver, wall_time_s=wall_time_s))


def first_choice(allowed: Collection[str] | None, names: Sequence[str]) -> str:
    """The handcrafted schedule simulated even without a budget: the first allowed one in tie
    preference (1F1B, the layout search's own pipeline model, when allowed), else the first of
    all as CP-SAT's seed."""
    usable = [name for name in names if allowed is None or name in allowed] or list(names)
    return min(usable, key=preference)


def _handcrafted_within(
    specs: dict[tuple, PipelineSpec], allowed: Collection[str] | None, deadline: float
) -> dict[tuple, list[tuple[Schedule, SimulationResult]]]:
    """Every replica's first-choice handcrafted schedule, simulated; then, slowest replica first, the
    others while time remains. A plan needs one timeline per replica, so that much is spent whatever
    the budget; simulating the rest of them takes tenths of a second on long pipelines."""
    schedules = {key: handcrafted_schedules(spec) for key, spec in specs.items()}
    runs = {}
    for key, spec in specs.items():
        first = first_choice(allowed, [schedule.name for schedule in schedules[key]])
        runs[key] = [(schedule, simulate(schedule, spec)) for schedule in schedules[key] if schedule.name == first]
    for key in sorted(specs, key=lambda key: -runs[key][0][1].makespan_ms):
        for schedule in schedules[key]:
            if time.monotonic() >= deadline:
                return runs
            if schedule.name != runs[key][0][0].name and (allowed is None or schedule.name in allowed):
                runs[key].append((schedule, simulate(schedule, specs[key])))
    return runs


def _apply(
    problem: PlanningProblem,
    result: PlanResult,
    groups: dict[tuple, list[ReplicaResult]],
    chosen: dict[tuple, ChosenSchedule],
) -> PlanResult:
    v = result.virtual_stages
    replicas = []
    for replica in result.replicas:
        simulation = chosen[timeline_signature(replica)].simulation
        stages = tuple(
            replace(stage, memory_gib=round(stage.static_memory_gib + simulation.peak_activation_gib[i], 3))
            for i, stage in enumerate(replica.stages)
        )
        replicas.append(replace(replica, stages=stages))

    def bubble_model_ms(replica: ReplicaResult) -> float:
        return pipeline_time_ms([s.forward_ms + s.backward_ms for s in replica.stages], replica.num_microbatches, v)

    modelled_ms = max(bubble_model_ms(r) for r in result.replicas if r.num_microbatches > 0)
    slowest_key = max(chosen, key=lambda key: chosen[key].simulation.makespan_ms)
    slowest = chosen[slowest_key]
    shift_ms = slowest.simulation.makespan_ms - modelled_ms
    iteration_ms = result.predicted.iteration_time_s * 1e3 + shift_ms
    breakdown = dict(result.predicted.breakdown)
    breakdown["pipeline_bubble_s"] = breakdown.get("pipeline_bubble_s", 0.0) + shift_ms / 1e3
    devices_used = sum(len(s.devices) for r in result.replicas for s in r.stages)
    choice = ScheduleChoice(
        name=slowest.schedule.name,
        candidates_ms=slowest.candidates_ms,
        replicas=tuple(
            ReplicaTimeline(
                replica_ids=tuple(r.id for r in groups[key]),
                schedule=chosen[key].schedule,
                simulation=chosen[key].simulation,
            )
            for key in groups
        ),
    )
    return replace(
        result,
        replicas=tuple(replicas),
        schedule=slowest.schedule.name,
        predicted=predicted_figures(problem, devices_used, iteration_ms, breakdown),
        pipeline_schedule=choice,
    )
