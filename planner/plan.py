"""Planner entry points: problem in, plan out.

`plan` searches the uniform space (`search.py`) and, when non-uniform layouts
are allowed, the failure-aware non-uniform space (`nonuniform.py`), the two
interleaved by bound with one shared incumbent; the answer is the better of
the two, optimal over their union when both searches finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from cost_models.pipeline import pipeline_time_ms
from planner.assemble import assemble_plan, finish_plan
from planner.assemble_nonuniform import assemble_replicas
from planner.errors import InfeasibleError
from planner.gc_pause import gc_paused
from planner.infeasibility import explain_infeasible, obvious_infeasibility
from planner.nonuniform import (
    PRUNE_TOLERANCE,
    NonUniformLayout,
    NonUniformResult,
    NonUniformSearch,
    recost,
)
from planner.problem import PlanningProblem
from planner.result import PlanResult, SolverResult
from planner.schedules.for_plan import MAX_OPTIMIZE_S_PER_REPLICA, with_schedules
from planner.search import SearchResult, UniformSearch, search
from planner.templates import stage_timings

# Share of the time limit kept for choosing schedules once the layout is known.
SCHEDULE_TIME_SHARE = 0.1


# What finishing a plan costs per GPU after the layout search: assembling replicas and stages,
# one simulated timeline per distinct replica, and the wire answer. Measured on the 2-core
# benchmark machine (~0.45 s at 65,536 GPUs); the search stops this much early so the answer
# arrives within `time_limit_s`.
FINISH_S_PER_GPU = 7e-6


def schedule_budget_s(problem: PlanningProblem) -> float:
    return min(MAX_OPTIMIZE_S_PER_REPLICA, SCHEDULE_TIME_SHARE * problem.time_limit_s)


def schedule_time_s(problem: PlanningProblem, left_s: float) -> float:
    """The schedule step's time: its budget, or what the layout search left of the time limit when
    that is more (a search that finished early leaves time for list schedules), never more than one
    CP-SAT schedule's cap and never past the time limit."""
    return min(max(schedule_budget_s(problem), left_s), MAX_OPTIMIZE_S_PER_REPLICA, max(0.0, left_s))


def finish_reserve_s(problem: PlanningProblem) -> float:
    return FINISH_S_PER_GPU * problem.cluster.total_devices


def plan_uniform(problem: PlanningProblem) -> PlanResult:
    """The best uniform layout on the healthy devices under the cost model, with its schedule."""
    return _within_time_limit(problem, lambda layout_problem: assemble_plan(problem, search(layout_problem)))


@gc_paused()
def plan(problem: PlanningProblem) -> PlanResult:
    """The best layout for the cluster as it is now (uniform only when `stock_layouts_only`)."""
    obvious = obvious_infeasibility(problem)
    if obvious is not None:
        raise InfeasibleError(obvious)
    if problem.stock_layouts_only:
        return plan_uniform(problem)
    return _within_time_limit(problem, _plan_layout)


def _within_time_limit(problem: PlanningProblem, layout_search: Callable[[PlanningProblem], PlanResult]) -> PlanResult:
    """The layout search, then schedules, both inside `time_limit_s`: the search gets the limit less
    the schedule budget and the finishing reserve."""
    started = time.monotonic()
    layout_s = max(0.0, problem.time_limit_s - schedule_budget_s(problem) - finish_reserve_s(problem))
    layout = layout_search(replace(problem, time_limit_s=layout_s))
    return with_schedules(problem, layout, schedule_time_s(problem, started + problem.time_limit_s - time.monotonic()))


def _plan_layout(problem: PlanningProblem) -> PlanResult:
    """Both searches interleaved best bound first, sharing one incumbent: neither spends time on
    layouts the other has already beaten, and together they stop as soon as no bound in either
    beats the best layout found."""
    started = time.monotonic()
    deadline = started + problem.time_limit_s
    uniform = UniformSearch(problem)
    nonuniform = NonUniformSearch(problem)
    while time.monotonic() < deadline:
        incumbent = min(uniform.best_ms, nonuniform.best_ms)
        next_uniform, next_nonuniform = uniform.next_bound_ms(), nonuniform.next_bound_ms()
        if min(next_uniform, next_nonuniform) >= incumbent * (1 - PRUNE_TOLERANCE):
            break
        if next_uniform <= next_nonuniform:
            uniform.step(deadline)
        else:
            nonuniform.step(deadline, incumbent)
    best_uniform = uniform.result()
    found = nonuniform.result(best_uniform.objective_ms if best_uniform is not None else float("inf"))
    if found.layout is None:
        if best_uniform is None:
            raise InfeasibleError(explain_infeasible(problem))
        return _uniform_with_combined_status(problem, best_uniform, found, started)
    return _assemble_nonuniform(problem, found, best_uniform, started)


def _combined_bound(uniform: SearchResult | None, found: NonUniformResult, value: float) -> tuple[float, bool]:
    """Bound over the union of both spaces; optimal when the non-uniform search finished and
    neither it nor the (possibly cut-short) uniform search leaves a bound below the answer."""
    uniform_bound = uniform.bound_ms if uniform is not None else float("inf")
    bound = min(value, uniform_bound, found.bound_ms)
    optimal = found.exhausted and bound >= value * (1 - 1e-6)
    return (value if optimal else bound), optimal


def _solver(value: float, bound: float, optimal: bool, started: float, total: int, solved: int) -> SolverResult:
    return SolverResult(
        status="OPTIMAL" if optimal else "FEASIBLE",
        wall_time_s=round(time.monotonic() - started, 3),
        gap=round(max(0.0, (value - bound) / value) if value > 0 else 0.0, 6),
        objective_ms=round(value, 3),
        bound_ms=round(bound, 3),
        candidates_total=total,
        candidates_solved=solved,
    )


def _uniform_with_combined_status(
    problem: PlanningProblem, uniform: SearchResult, found: NonUniformResult, started: float
) -> PlanResult:
    bound, optimal = _combined_bound(uniform, found, uniform.objective_ms)
    result = assemble_plan(problem, uniform)
    solver = _solver(uniform.objective_ms, bound, optimal, started,
                     uniform.candidates_total + found.outer_total, uniform.candidates_solved + found.outer_solved)
    return replace(result, solver=solver, status="optimal" if optimal else "feasible")


def _breakdown(problem: PlanningProblem, layout: NonUniformLayout) -> dict[str, float]:
    """Seconds on the slowest replica's bottleneck stage; the parts sum to the iteration."""
    v = layout.outer.virtual_stages
    slowest = max(layout.replica_plan(), key=lambda item: pipeline_time_ms(item[0].stage_ms, max(item[1]), v))
    template, microbatches = slowest
    m = max(microbatches)
    pipeline = pipeline_time_ms(template.stage_ms, m, v)
    k = max(range(len(template.stage_ms)), key=lambda i: template.stage_ms[i])
    stage = stage_timings(layout.terms_cache(problem), template)[k]
    sync_and_step = layout.iteration_ms - pipeline
    used = [t for t, n in zip(layout.templates, layout.allocation.replicas_per_template) if n > 0]
    optimizer = max(t.optimizer_ms for t in used)
    return {
        "compute_s": m * stage.compute_ms / 1e3,
        "tp_comm_s": m * stage.tp_comm_ms / 1e3,
        "pp_comm_s": m * stage.p2p_ms / 1e3,
        "pipeline_bubble_s": (pipeline - m * stage.total_ms) / 1e3,
        "dp_comm_s": (sync_and_step - optimizer) / 1e3,
        "optimizer_s": optimizer / 1e3,
    }


def _assemble_nonuniform(
    problem: PlanningProblem, found: NonUniformResult, uniform: SearchResult | None, started: float
) -> PlanResult:
    layout = recost(problem, found.layout)
    replicas, used = assemble_replicas(problem, layout)
    bound, optimal = _combined_bound(uniform, found, layout.iteration_ms)
    total = found.outer_total + (uniform.candidates_total if uniform else 0)
    solved = found.outer_solved + (uniform.candidates_solved if uniform else 0)
    outer = layout.outer
    return finish_plan(
        problem, tuple(replicas), used, layout.iteration_ms, _breakdown(problem, layout),
        _solver(layout.iteration_ms, bound, optimal, started, total, solved),
        micro_batch_size=outer.micro_batch_size,
        schedule="interleaved" if outer.virtual_stages > 1 else "1f1b",
        virtual_stages=outer.virtual_stages,
        recompute=outer.recompute,
    )
