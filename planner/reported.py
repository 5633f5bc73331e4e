"""A plan's solver report in the number the plan reports: its simulated iteration time.

`objective_ms` is 1000 x `predicted.iteration_time_s`; `bound_ms` is a bound the caller proved on the
reported time of every layout of the searched space (never above the objective); the plan is OPTIMAL
only when the bound meets the objective, and `gap` is the distance between them.
"""

from __future__ import annotations

from dataclasses import replace

from planner.errors import InfeasibleError
from planner.problem import PlanningProblem
from planner.result import PlanResult

SEARCH_FINISHED, WORK_BUDGET_STOP, WALL_CLOCK_STOP = "search finished", "work budget", "wall clock"
FIXED_STATUS, FIXED_SOLVER_STATUS = "fixed", "FIXED"  # an estimate: a layout given, nothing searched
WIRE_ROUNDING_MS = 1e-3  # the wire rounds times to 1 us


def as_reported(problem: PlanningProblem, result: PlanResult, bound_ms: float, *, exact_search: bool) -> PlanResult:
    """`result` with its solver report in the reported number, against `bound_ms`.

    `exact_search`: the search priced layouts in the reported number itself (the stock search), so a
    finished search that still falls short of its bound means the schedules it priced were not all
    simulated in time: the report says the work budget stopped it. The failure-aware searches price the
    bubble model, so there a finished search may well leave a gap to the bound on reported times."""
    objective = round(result.predicted.iteration_time_s * 1e3, 3)
    bound = min(bound_ms, objective)
    optimal = bound >= objective * (1 - problem.config.prune_tolerance) - WIRE_ROUNDING_MS
    stop = result.solver.stopped_by
    if exact_search and not optimal and stop == SEARCH_FINISHED:
        stop = WORK_BUDGET_STOP
    solver = replace(result.solver, status="OPTIMAL" if optimal else "FEASIBLE", objective_ms=objective,
                     bound_ms=objective if optimal else round(bound, 3),
                     gap=0.0 if optimal else round((objective - bound) / objective, 6), stopped_by=stop)
    return replace(result, solver=solver, status="optimal" if optimal else "feasible")


def as_fixed_layout(result: PlanResult) -> PlanResult:
    """An estimate's report: nothing was searched, so its status is `fixed` (solver `FIXED`, no stop reason), and
    objective and bound are both the reported time."""
    reported = round(result.predicted.iteration_time_s * 1e3, 3)
    solver = replace(result.solver, status=FIXED_SOLVER_STATUS, objective_ms=reported, bound_ms=reported, gap=0.0,
                     stopped_by=None)
    return replace(result, status=FIXED_STATUS, solver=solver)


def refuse_overflow(problem: PlanningProblem, result: PlanResult) -> PlanResult:
    """`result`, unless its schedule keeps more activations in flight than some stage's GPUs hold: then
    the layout does not run as given (the memory check before scheduling assumes 1F1B's in-flight count)."""
    capacity_gib = problem.usable_memory_gib
    for replica in result.replicas:
        for stage in replica.stages:
            # Stage figures are rounded to 1e-3 GiB.
            if stage.memory_gib > capacity_gib + 1e-3:
                raise InfeasibleError(
                    f"replica {replica.id} stage {stage.id}: the {result.schedule} schedule keeps "
                    f"{stage.memory_gib - stage.static_memory_gib:.2f} GiB of activations in flight beside "
                    f"{stage.static_memory_gib:.2f} GiB of weights and state, {stage.memory_gib:.2f} GiB per GPU; "
                    f"{problem.capacity_text()}. A schedule with fewer microbatches in "
                    "flight (1f1b), a smaller micro_batch_size or recompute fits better"
                )
    return result
