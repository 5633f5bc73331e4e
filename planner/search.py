"""Branch and bound over candidate shapes, CP-SAT for each one's layer split.

Candidates come sorted by a lower bound valid for every split. A cheap
incumbent (the even split of the best-bounded candidates) prunes first; then
CP-SAT runs on candidates in bound order until the next bound is no better
than the incumbent or the time budget ends. The reported bound is the
smallest bound of everything not proven worse, so the gap is honest when
time runs out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cost_models.iteration import IterationEstimate, estimate_iteration
from planner.candidates import Candidate, ranked_candidates, split_fits
from planner.errors import InfeasibleError
from planner.infeasibility import explain_infeasible
from planner.layer_split import solve_split
from planner.problem import PlanningProblem

# "This bound cannot beat the incumbent", relatively: CP-SAT's objective is
# exact only to its 1 us time quantum per coefficient.
PRUNE_TOLERANCE = 1e-6
# Candidates (best bounds first) whose even split seeds the incumbent.
SEED_CANDIDATES = 64


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
    candidates_solved: int

    @property
    def gap(self) -> float:
        if self.objective_ms <= 0:
            return 0.0
        return max(0.0, (self.objective_ms - self.bound_ms) / self.objective_ms)


def evaluate(
    candidate: Candidate,
    layers_per_stage: tuple[int, ...],
    replica_speeds: tuple[tuple[float, ...], ...] | None = None,
) -> IterationEstimate:
    """The slowest replica's estimate for this split (the iteration waits for it)."""
    speeds = replica_speeds or candidate.replica_speeds
    estimates = [estimate_iteration(candidate.terms, layers_per_stage, vector) for vector in speeds]
    return max(estimates, key=lambda e: e.iteration_ms)


def even_split(pp: int, num_layers: int) -> tuple[int, ...]:
    """Layers as even as possible, the extra ones on middle stages (the ends carry embedding and head)."""
    base, extra = divmod(num_layers, pp)
    order = list(range(1, pp - 1)) + [0, pp - 1] if pp > 2 else list(range(pp))
    split = [base] * pp
    for stage in order[:extra]:
        split[stage] += 1
    return tuple(split)


def _fits(split: tuple[int, ...], caps: tuple[int, ...], stock_only: bool) -> bool:
    if any(n < 1 or n > cap for n, cap in zip(split, caps)):
        return False
    return not stock_only or len(set(split[1:-1])) <= 1


def search(problem: PlanningProblem) -> SearchResult:
    started = time.monotonic()
    deadline = started + problem.time_limit_s
    num_layers = problem.workload.model.num_layers
    capacity = problem.hardware.gpu.memory_bytes
    stock_only = problem.stock_layouts_only
    candidates = ranked_candidates(problem)

    caps: dict[int, tuple[int, ...] | None] = {}

    def memory_caps(index: int) -> tuple[int, ...] | None:
        """Per-stage layer caps, or None when no split of the allowed form fits."""
        if index not in caps:
            candidate = candidates[index]
            limits = candidate.max_layers(capacity)
            caps[index] = limits if split_fits(candidate.shape, limits, num_layers, stock_only) else None
        return caps[index]

    best: tuple[float, int, tuple[int, ...]] | None = None
    for index in range(min(len(candidates), SEED_CANDIDATES)):
        limits = memory_caps(index)
        split = even_split(candidates[index].shape.pp, num_layers)
        if limits is None or not _fits(split, limits, stock_only):
            continue
        value = evaluate(candidates[index], split).iteration_ms
        if best is None or value < best[0]:
            best = (value, index, split)

    solved = 0
    bound = float("inf")
    exhausted = True
    for index, candidate in enumerate(candidates):
        if best is not None and candidate.lower_bound_ms >= best[0] * (1 - PRUNE_TOLERANCE):
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            exhausted = False
            bound = min(bound, candidate.lower_bound_ms)
            break
        limits = memory_caps(index)
        if limits is None:
            continue
        result = solve_split(candidate, limits, num_layers, stock_only, remaining, problem.random_seed)
        solved += 1
        if result is None:
            continue
        if not result.optimal:
            bound = min(bound, result.bound_ms)
        value = evaluate(candidate, result.layers_per_stage).iteration_ms
        if best is None or value < best[0]:
            best = (value, index, result.layers_per_stage)
    if best is None:
        raise InfeasibleError(explain_infeasible(problem))

    value, index, split = best
    bound = min(bound, value)
    optimal = exhausted and bound >= value * (1 - PRUNE_TOLERANCE)
    return SearchResult(
        candidate=candidates[index],
        layers_per_stage=split,
        estimate=evaluate(candidates[index], split),
        objective_ms=value,
        bound_ms=value if optimal else bound,
        optimal=optimal,
        wall_time_s=time.monotonic() - started,
        candidates_total=len(candidates),
        candidates_solved=solved,
    )
