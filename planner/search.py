"""Branch and bound over candidate shapes, CP-SAT for each one's layer split.

Candidates come sorted by a lower bound valid for every split. A cheap
incumbent (the even split of each candidate) prunes first; then CP-SAT runs
on candidates in bound order until the next bound is no better than the
incumbent or the time budget ends. The reported gap is against the smallest
bound of everything not proven worse.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cost_models.iteration import IterationEstimate, estimate_iteration
from planner.candidates import Candidate, feasible_candidates
from planner.errors import InfeasibleError
from planner.infeasibility import explain_infeasible
from planner.layer_split import solve_split
from planner.problem import PlanningProblem

# Relative tolerance for "this bound cannot beat the incumbent": the
# CP-SAT objective is exact only to its time quantum.
_PRUNE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class SearchResult:
    candidate: Candidate
    layers_per_stage: tuple[int, ...]
    estimate: IterationEstimate  # the slowest replica
    objective_ms: float
    bound_ms: float
    optimal: bool
    wall_time_s: float
    candidates_total: int
    candidates_feasible: int
    candidates_solved: int

    @property
    def gap(self) -> float:
        if self.objective_ms <= 0:
            return 0.0
        return max(0.0, (self.objective_ms - self.bound_ms) / self.objective_ms)


def evaluate(candidate: Candidate, layers_per_stage: tuple[int, ...]) -> IterationEstimate:
    """The slowest replica's estimate for this split (the iteration waits for it)."""
    estimates = [estimate_iteration(candidate.terms, layers_per_stage, speeds) for speeds in candidate.replica_speeds]
    return max(estimates, key=lambda e: e.iteration_ms)


def even_split(candidate: Candidate, num_layers: int) -> tuple[int, ...] | None:
    """Layers as even as possible, extra layers on the middle stages; None if it does not fit."""
    p = candidate.shape.pp
    base, extra = divmod(num_layers, p)
    order = list(range(1, p - 1)) + [0, p - 1] if p > 2 else list(range(p))
    split = [base] * p
    for stage in order[:extra]:
        split[stage] += 1
    if any(n < 1 or n > cap for n, cap in zip(split, candidate.max_layers)):
        return None
    return tuple(split)


def search(problem: PlanningProblem) -> SearchResult:
    started = time.monotonic()
    deadline = started + problem.time_limit_s
    num_layers = problem.workload.model.num_layers
    candidates, total = feasible_candidates(problem)
    if not candidates:
        raise InfeasibleError(explain_infeasible(problem))

    best: tuple[float, Candidate, tuple[int, ...], bool] | None = None
    for candidate in candidates[: max(1, min(len(candidates), 64))]:
        split = even_split(candidate, num_layers)
        if split is None or (problem.stock_layouts_only and not _is_stock_split(split)):
            continue
        value = evaluate(candidate, split).iteration_ms
        if best is None or value < best[0]:
            best = (value, candidate, split, False)

    solved = 0
    bound = float("inf")
    exhausted = True
    for index, candidate in enumerate(candidates):
        if best is not None and candidate.lower_bound_ms >= best[0] * (1 - _PRUNE_TOLERANCE):
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            exhausted = False
            bound = min(bound, candidate.lower_bound_ms)
            break
        result = solve_split(candidate, num_layers, problem.stock_layouts_only, remaining, problem.random_seed)
        solved += 1
        if result is None:
            continue
        if not result.optimal:
            bound = min(bound, result.bound_ms)
        value = evaluate(candidate, result.layers_per_stage).iteration_ms
        if best is None or value < best[0]:
            best = (value, candidate, result.layers_per_stage, result.optimal)
    if best is None:
        raise InfeasibleError(explain_infeasible(problem))

    value, candidate, split, _ = best
    bound = min(bound, value)
    optimal = exhausted and bound >= value * (1 - _PRUNE_TOLERANCE)
    return SearchResult(
        candidate=candidate,
        layers_per_stage=split,
        estimate=evaluate(candidate, split),
        objective_ms=value,
        bound_ms=value if optimal else bound,
        optimal=optimal,
        wall_time_s=time.monotonic() - started,
        candidates_total=total,
        candidates_feasible=len(candidates),
        candidates_solved=solved,
    )


def _is_stock_split(split: tuple[int, ...]) -> bool:
    return len(set(split[1:-1])) <= 1
