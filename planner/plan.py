"""Planner entry point: problem in, plan out."""

from __future__ import annotations

from planner.assemble import assemble_plan
from planner.problem import PlanningProblem
from planner.result import PlanResult
from planner.search import search


def plan_uniform(problem: PlanningProblem) -> PlanResult:
    """The best uniform layout on the healthy devices under the cost model.

    Raises InfeasibleError (with the numbers) when nothing fits.
    """
    return assemble_plan(problem, search(problem))
