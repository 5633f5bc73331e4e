"""`training.zero_stage: "auto"`: the ZeRO stage as one more decision of the plan.

Each stage is its own layout space (stages 2 and 3 on stock layouts; `cost_models.sharded_dp` prices
them), so the choice is made by planning each stage on its share of the budget and keeping the least
reported time, ties to the lower stage (less traffic for the same time). The answer's bound is the least
of the searches' bounds, so `status: optimal` holds over the union of the three spaces. ZeRO-0 is not
searched: ZeRO-1 holds less in memory and moves the same bytes (a reduce-scatter and an all-gather for
an all-reduce), with a shorter optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from planner.budget import Budget
from planner.errors import InfeasibleError
from planner.problem import PlanningProblem
from planner.reported import as_reported
from planner.result import PlanResult

# Each stage's share of the budget left when its search starts: half to ZeRO-1 (the failure-aware
# search, when allowed), then half of the rest to ZeRO-2 and all that remains to ZeRO-3.
STAGE_SHARES = ((1, 0.5), (2, 0.5), (3, 1.0))


def with_zero_stage(problem: PlanningProblem, stage: int) -> PlanningProblem:
    """`problem` at one ZeRO stage. Stages 2 and 3 plan stock layouts: replicas of different shapes share
    gradients through resiplan's resharded sync, which shards optimizer state only."""
    return replace(problem, workload=replace(problem.workload, zero_stage=stage), zero_stage_auto=False,
                   stock_layouts_only=problem.stock_layouts_only or stage >= 2)


def plan_each_zero_stage(problem: PlanningProblem, budget: Budget,
                         plan_one: Callable[[PlanningProblem, Budget], PlanResult]) -> PlanResult:
    """The fastest of `plan_one`'s plans at ZeRO stages 1, 2 and 3; InfeasibleError naming each stage's
    reason when none has a layout."""
    plans: list[PlanResult] = []
    outcomes: list[str] = []
    for stage, share in STAGE_SHARES:
        try:
            found = plan_one(with_zero_stage(problem, stage), budget.share(share))
        except InfeasibleError as error:
            outcomes.append(f"zero_stage {stage}: no layout ({error})")
            continue
        plans.append(found)
        outcomes.append(f"zero_stage {stage}: {found.predicted.iteration_time_s:.4f} s ({found.solver.status})")
    if not plans:
        raise InfeasibleError("; ".join(outcomes))
    best = min(plans, key=lambda found: (found.predicted.iteration_time_s, found.zero_stage))
    chosen = with_zero_stage(problem, best.zero_stage)
    noted = replace(best, solver=replace(best.solver, notes=(*best.solver.notes, "zero_stage auto: " + "; ".join(outcomes))))
    return as_reported(chosen, noted, min(found.solver.bound_ms for found in plans),
                       exact_search=problem.stock_layouts_only)
