"""Give a plan its schedules: one simulated timeline per distinct replica.

The layout search prices pipelines with the 1F1B bubble model; here every
distinct replica gets the fastest schedule that fits its memory, found by
simulation (and CP-SAT for the slowest replicas while time remains). The
plan's iteration time then moves by exactly what the slowest replica's
simulated makespan differs from the bubble model, so `predicted` and the
returned timelines are the same numbers, and each stage's `memory_gib`
becomes its static memory plus the chosen schedule's activation peak.

The step keeps the budget's deadline and degrades rather than overruns:
with little time left only each replica's first-choice handcrafted schedule
(the order the layout search priced) is simulated, with no list or CP-SAT
schedules; and when even one exact timeline per distinct replica would not
fit (`planner.deadline.ops_cost_s`),
replicas alike in everything but their stages' speeds share one timeline:
their envelope's, each op as long as in the slowest of them. Its order is
theirs, so are its activation peaks (which depend on the order alone), and
its times bound theirs from above (in a fixed order no op ends earlier
because another took longer), so the plan's iteration time is then an upper
bound, and the plan says so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import replace

from cost_models.choices import ScheduleName
from cost_models.pipeline import pipeline_time_ms
from planner.assemble import predicted_figures
from planner.budget import Budget
from planner.config import PlannerConfig
from planner.deadline import TIMELINE_WIRE_SHARE, ops_cost_s
from planner.problem import PlanningProblem
from planner.result import PlanResult, ReplicaResult
from planner.schedules.bounds import lower_bound_ms
from planner.schedules.build import replica_spec, timeline_signature
from planner.schedules.choose import (
    ChosenSchedule,
    best_run,
    choose_schedule,
    cp_sat_ops,
    preference,
)
from planner.schedules.handcrafted import handcrafted_names, handcrafted_schedule
from planner.schedules.ops import PipelineSpec, Schedule
from planner.schedules.optimal import OPTIMIZED
from planner.schedules.result import ReplicaTimeline, ScheduleChoice
from planner.schedules.simulator import SimulationResult, simulate, validate
from planner.work import Work

# CP-SAT limits are whole multiples of this (`_quantized_limit_s`).
CP_SAT_LIMIT_STEP_S = 0.25
SHARED_TIMELINES_NOTE = (
    "replicas alike but for their stages' speeds share one timeline, their envelope's (each op as long as in "
    "the slowest of them), to answer in time: predicted.iteration_time_s is an upper bound"
)

Key = tuple


def with_schedules(
    problem: PlanningProblem, result: PlanResult, budget: Budget, optional_s: float = float("inf")
) -> PlanResult:
    """`result` with a simulated timeline per distinct replica, by the budget's deadline when that
    is possible at all (the first-choice timelines are simulated whatever the budget); better
    schedules than the first choices are looked for during at most `optional_s` of it."""
    started = time.monotonic()
    allowed = problem.allowed_schedules
    gpu_memory_gib = problem.usable_memory_gib
    groups = _exact_groups(result.replicas)
    specs = {key: replica_spec(members[0], result.virtual_stages, gpu_memory_gib) for key, members in groups.items()}
    notes: tuple[str, ...] = ()
    if timeline_cost_s(specs.values()) > budget.remaining_s():
        envelopes = _envelope_groups(result.replicas)
        if len(envelopes) < len(groups):
            groups, notes = envelopes, (SHARED_TIMELINES_NOTE,)
            specs = {key: replica_spec(_envelope(members), result.virtual_stages, gpu_memory_gib)
                     for key, members in groups.items()}
    if (cost_s := timeline_cost_s(specs.values())) > budget.remaining_s():
        # Nothing left to give up: a plan carries one timeline per distinct replica.
        notes += (_overrun_note(specs.values(), cost_s, budget.remaining_s()),)
    # What the timelines cost to carry to the client comes off the time for better schedules.
    budget = budget.less(TIMELINE_WIRE_SHARE * timeline_cost_s(specs.values())).capped(optional_s)
    handcrafted = _handcrafted_within(specs, allowed, budget)
    min_gain_ms = problem.config.min_iteration_gain * result.predicted.iteration_time_s * 1e3
    chosen = {key: choose_schedule(spec, allowed=allowed, simulated=handcrafted[key], config=problem.config) for key, spec in specs.items()}
    # Greedy list schedules first, for the slowest replica again and again (the plan waits only for
    # it): milliseconds each, and often at the lower bound already, so CP-SAT has less left to gain.
    # On long pipelines (p = 32, m = 128) they take tenths of a second: only while the budget lasts.
    listed: set[Key] = set()
    while (
        (slowest := max(chosen, key=lambda key: chosen[key].simulation.reported_ms)) not in listed
        and not budget.expired()
    ):
        listed.add(slowest)
        chosen[slowest] = choose_schedule(
            specs[slowest], allowed=allowed, optimize_time_limit_s=problem.config.min_optimize_s, min_gain_ms=min_gain_ms,
            seed=problem.random_seed, simulated=handcrafted[slowest], use_solver=False, config=problem.config,
        )
        budget.charge(Work.SCHEDULE_OP, timeline_ops(specs[slowest]))
    bounds = {key: lower_bound_ms(spec) for key, spec in specs.items()}

    # CP-SAT only pays where it lowers the iteration: on the slowest replica, again and again, while
    # the plan's pipeline is more than the gain threshold above what every replica's bound allows.
    optimized: set[Key] = set()
    while (remaining := budget.remaining_s()) > problem.config.min_optimize_s:
        slowest = max(chosen, key=lambda key: chosen[key].simulation.reported_ms)
        if slowest in optimized or chosen[slowest].simulation.reported_ms - max(bounds.values()) <= min_gain_ms:
            break
        if cp_sat_ops(specs[slowest]) > problem.config.max_improved_ops:
            break  # its presolve would outlast the counted work (`max_improved_ops`)
        optimized.add(slowest)
        current = chosen[slowest].schedule
        chosen[slowest] = choose_schedule(
            specs[slowest], allowed=allowed, optimize_time_limit_s=_quantized_limit_s(remaining, problem.config),
            min_gain_ms=min_gain_ms, seed=problem.random_seed, simulated=handcrafted[slowest],
            start=current if current.name == OPTIMIZED else None, config=problem.config,
        )
        budget.charge(Work.CP_SAT, chosen[slowest].solver_deterministic_time)
        budget.charge(Work.SCHEDULE_OP, timeline_ops(specs[slowest]))
    scheduled = _apply(problem, result, groups, chosen)
    # The solver's wall time covers the whole answer: layout search and schedules.
    solver = replace(scheduled.solver, wall_time_s=round(result.solver.wall_time_s + time.monotonic() - started, 3))
    if SHARED_TIMELINES_NOTE in notes:
        solver = replace(solver, status="FEASIBLE")
        scheduled = replace(scheduled, status="feasible")
    return replace(scheduled, solver=replace(solver, notes=(*solver.notes, *notes)))


def _quantized_limit_s(remaining_s: float, config: PlannerConfig) -> float:
    """CP-SAT's limit for one replica: what is left, at most the per-replica cap, rounded down to
    `CP_SAT_LIMIT_STEP_S`. CP-SAT counts it in deterministic work, but what is left after the list schedules
    depends on how fast they ran: rounded, the same request gets the same limit, so the same schedule, on a
    faster or busier machine (a sample's schedule moved 0.4% between two machines before)."""
    capped = min(remaining_s, config.max_optimize_s_per_replica)
    return max(config.min_optimize_s, math.floor(capped / CP_SAT_LIMIT_STEP_S) * CP_SAT_LIMIT_STEP_S)


def handcrafted_reported_ms(problem: PlanningProblem, result: PlanResult) -> float:
    """The iteration time `with_schedules` reports for `result` when every distinct replica runs its
    best allowed handcrafted schedule (`best_run`, as `choose_schedule` picks; every handcrafted one
    seeds CP-SAT when only `optimized` is allowed): what a layout search prices a layout at before
    giving it list or CP-SAT schedules, which can only lower it."""
    allowed = problem.allowed_schedules
    groups = _exact_groups(result.replicas)
    orders: dict[tuple, Schedule] = {}
    slowest_ms = 0.0
    for members in groups.values():
        spec = replica_spec(members[0], result.virtual_stages, problem.usable_memory_gib)
        names = handcrafted_names(spec.virtual_stages)
        if allowed is not None and any(name in allowed for name in names):
            names = tuple(name for name in names if name in allowed)
        runs = []
        for name in names:
            shape = (name, spec.num_stages, spec.num_microbatches, spec.virtual_stages)
            if shape not in orders:
                orders[shape] = handcrafted_schedule(name, *shape[1:])
                validate(orders[shape], spec)
            runs.append((orders[shape], simulate(orders[shape], spec, validated=True)))
        slowest_ms = max(slowest_ms, best_run(runs, spec)[1].reported_ms)
    return result.predicted.iteration_time_s * 1e3 + slowest_ms - _bubble_model_ms(result)


def reported_floor_ms(problem: PlanningProblem, result: PlanResult) -> float:
    """Below the iteration `with_schedules` can report for `result`, whatever schedules it finds: each distinct
    replica's makespan bound (`lower_bound_ms`), less its whole priced gradient sync where breadth-first pipelining
    (chunked stages only) may hide it (`planner.schedules.sync`: a schedule's sync shift is never below that)."""
    allowed = problem.allowed_schedules
    may_hide_sync = result.virtual_stages > 1 and (allowed is None or ScheduleName.LOOPED_BFS in allowed)
    slowest_ms = 0.0
    for members in _exact_groups(result.replicas).values():
        spec = replica_spec(members[0], result.virtual_stages, problem.usable_memory_gib)
        floor_ms = lower_bound_ms(spec)
        if may_hide_sync and spec.grad_sync is not None:
            floor_ms -= max(sync.exposed_ms for sync in spec.grad_sync)
        slowest_ms = max(slowest_ms, floor_ms)
    return result.predicted.iteration_time_s * 1e3 + slowest_ms - _bubble_model_ms(result)


def handcrafted_ops(problem: PlanningProblem, result: PlanResult) -> int:
    """About the ops `handcrafted_reported_ms` simulates: every allowed handcrafted schedule of each distinct
    replica."""
    allowed = problem.allowed_schedules
    names = handcrafted_names(result.virtual_stages)
    runs = max(1, sum(1 for name in names if allowed is None or name in allowed))
    return runs * sum(2 * len(members[0].stages) * result.virtual_stages * members[0].num_microbatches
                      for members in _exact_groups(result.replicas).values())


def handcrafted_cost_s(problem: PlanningProblem, result: PlanResult) -> float:
    """About what `handcrafted_reported_ms` takes."""
    return ops_cost_s(handcrafted_ops(problem, result))


def _bubble_model_ms(result: PlanResult) -> float:
    """The slowest replica's pipeline under the 1F1B bubble model, which `predicted` was priced at."""
    return max(pipeline_time_ms([s.forward_ms + s.backward_ms for s in r.stages], r.num_microbatches, result.virtual_stages)
               for r in result.replicas if r.num_microbatches > 0)


def _overrun_note(specs: Collection[PipelineSpec], cost_s: float, left_s: float) -> str:
    ops = sum(timeline_ops(spec) for spec in specs)
    return (f"the plan's {len(specs)} distinct timeline(s), {ops:,} ops in all, take about {cost_s:.2g} s to "
            f"simulate and send and {max(0.0, left_s):.2g} s were left: the answer arrives up to the difference past "
            "its time limit; fewer microbatches (a larger training.micro_batch_size) make the timelines shorter")


def timeline_ops(spec: PipelineSpec) -> int:
    """Ops in one first-choice timeline of `spec`: a forward and a backward per microbatch and chunk."""
    return 2 * spec.num_stages * spec.virtual_stages * spec.num_microbatches


def timeline_cost_s(specs: Collection[PipelineSpec]) -> float:
    """What simulating one timeline per spec and sending them costs, about."""
    return ops_cost_s(sum(timeline_ops(spec) for spec in specs))


def _exact_groups(replicas: Sequence[ReplicaResult]) -> dict[Key, list[ReplicaResult]]:
    groups: dict[Key, list[ReplicaResult]] = {}
    for replica in replicas:
        groups.setdefault(timeline_signature(replica), []).append(replica)
    return groups


def _envelope_groups(replicas: Sequence[ReplicaResult]) -> dict[Key, list[ReplicaResult]]:
    """Replicas alike in microbatches and in every stage's memory (so in tp, layers and position):
    they differ at most in their stages' speeds."""
    groups: dict[Key, list[ReplicaResult]] = {}
    for replica in replicas:
        key = ("envelope", replica.num_microbatches,
               tuple((s.activation_gib, s.static_memory_gib) for s in replica.stages))
        groups.setdefault(key, []).append(replica)
    return groups


def _envelope(members: Sequence[ReplicaResult]) -> ReplicaResult:
    """A replica each of whose ops takes as long as in the slowest of `members` (see the module docstring)."""
    stages = []
    for position, stage in enumerate(members[0].stages):
        alike = [member.stages[position] for member in members]
        weight_ms = max(s.weight_grad_ms for s in alike)
        input_ms = max(max(0.0, s.backward_ms - s.weight_grad_ms) for s in alike)
        stages.append(replace(stage, forward_ms=max(s.forward_ms for s in alike), backward_ms=input_ms + weight_ms,
                              weight_grad_ms=weight_ms))
    return replace(members[0], stages=tuple(stages))


def first_choice(allowed: Collection[str] | None, names: Sequence[str]) -> str:
    """The handcrafted schedule simulated even without a budget: the first allowed one in tie
    preference (1F1B, the layout search's own pipeline model, when allowed), else the first of
    all as CP-SAT's seed."""
    usable = [name for name in names if allowed is None or name in allowed] or list(names)
    return min(usable, key=preference)


def _handcrafted_within(
    specs: dict[Key, PipelineSpec], allowed: Collection[str] | None, budget: Budget
) -> dict[Key, list[tuple[Schedule, SimulationResult]]]:
    """Every replica's first-choice handcrafted schedule, simulated; then, slowest replica first, the
    others while time remains. A plan needs one timeline per replica, so that much is spent whatever
    the budget; simulating the rest of them takes tenths of a second on long pipelines. An order
    depends only on stages, microbatches and chunks: it is built and validated once per shape."""
    orders: dict[tuple, Schedule] = {}

    def run(name: str, spec: PipelineSpec) -> tuple[Schedule, SimulationResult]:
        shape = (name, spec.num_stages, spec.num_microbatches, spec.virtual_stages)
        if shape not in orders:
            orders[shape] = handcrafted_schedule(name, *shape[1:])
            validate(orders[shape], spec)
        budget.charge(Work.TIMELINE_OP, orders[shape].op_count)
        return orders[shape], simulate(orders[shape], spec, validated=True)

    names = {key: handcrafted_names(spec.virtual_stages) for key, spec in specs.items()}
    runs = {key: [run(first_choice(allowed, names[key]), spec)] for key, spec in specs.items()}
    for key in sorted(specs, key=lambda key: -runs[key][0][1].reported_ms):
        for name in names[key]:
            if budget.expired():
                return runs
            if name != runs[key][0][0].name and (allowed is None or name in allowed):
                runs[key].append(run(name, specs[key]))
    return runs


def _apply(
    problem: PlanningProblem,
    result: PlanResult,
    groups: dict[Key, list[ReplicaResult]],
    chosen: dict[Key, ChosenSchedule],
) -> PlanResult:
    key_of = {replica.id: key for key, members in groups.items() for replica in members}
    replicas = []
    for replica in result.replicas:
        simulation = chosen[key_of[replica.id]].simulation
        stages = tuple(
            replace(stage, memory_gib=round(stage.static_memory_gib + simulation.peak_activation_gib[i], 3))
            for i, stage in enumerate(replica.stages)
        )
        replicas.append(replace(replica, stages=stages))

    modelled_ms = _bubble_model_ms(result)
    slowest_key = max(chosen, key=lambda key: chosen[key].simulation.reported_ms)
    slowest = chosen[slowest_key]
    simulation = slowest.simulation
    iteration_ms = result.predicted.iteration_time_s * 1e3 + simulation.reported_ms - modelled_ms
    breakdown = dict(result.predicted.breakdown)
    breakdown["pipeline_bubble_s"] = breakdown.get("pipeline_bubble_s", 0.0) + (simulation.makespan_ms - modelled_ms) / 1e3
    breakdown["dp_comm_s"] = breakdown.get("dp_comm_s", 0.0) + simulation.sync_shift_ms / 1e3
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
