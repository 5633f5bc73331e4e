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
from planner.budget import Budget
from planner.deadline import ops_cost_s
from planner.errors import InfeasibleError
from planner.infeasibility import explain_infeasible
from planner.problem import PlanningProblem
from planner.uniform.candidates import (
    Candidate,
    ranked_candidates,
    split_fits,
    uniform_floor_ms,
)
from planner.uniform.layer_split import solve_split
from planner.uniform.placements import Placement
from planner.work import Work

# "This bound cannot beat the incumbent", relatively: CP-SAT's objective is
# exact only to its 1 us time quantum per coefficient.
# Candidates (best bounds first) whose even split seeds the incumbent.


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
    placement: Placement | None = None  # where degraded TP groups go; None: packed (`placements.packed`)

    @property
    def replica_speeds(self) -> tuple[tuple[float, ...], ...]:
        """The distinct speed vectors of the layout's replicas."""
        return self.placement.distinct if self.placement is not None else self.candidate.replica_speeds

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


class UniformSearch:
    """The branch and bound of `search`, one candidate at a time, so that another search can
    share its incumbent (`plan` interleaves it with the non-uniform one by bound)."""

    def __init__(self, problem: PlanningProblem, budget: Budget | None = None,
                 ranked: tuple[list[Candidate], bool] | None = None) -> None:
        """`ranked`, `ranked_candidates(problem, ...)` when the caller has them already."""
        self._problem = problem
        self._started = time.monotonic()
        budget = budget or Budget.unlimited()
        self._candidates, complete = ranked if ranked is not None else ranked_candidates(problem, budget)
        # Shapes the deadline left uncosted are bounded all together.
        self._bound = float("inf") if complete else uniform_floor_ms(problem)  # and by CP-SAT splits cut short
        self._caps: dict[int, tuple[int, ...] | None] = {}
        self._best: tuple[float, int, tuple[int, ...]] | None = None
        self._next = 0
        self._solved = 0
        self._seed(budget)

    @property
    def best_ms(self) -> float:
        return self._best[0] if self._best is not None else float("inf")

    def best_timeline_ops(self) -> int:
        """Ops of the first-choice timelines the best layout so far needs, one per distinct replica."""
        if self._best is None:
            return 0
        candidate = self._candidates[self._best[1]]
        shape = candidate.shape
        return 2 * shape.pp * shape.virtual_stages * candidate.terms.num_microbatches * len(candidate.replica_speeds)

    def next_bound_ms(self) -> float:
        """Lower bound of every candidate not yet solved (inf when none is left)."""
        if self._next >= len(self._candidates):
            return float("inf")
        return self._candidates[self._next].lower_bound_ms

    def _memory_caps(self, index: int) -> tuple[int, ...] | None:
        """Per-stage layer caps, or None when no split of the allowed form fits."""
        if index not in self._caps:
            problem, candidate = self._problem, self._candidates[index]
            limits = candidate.max_layers(problem.usable_memory_bytes)
            fits = split_fits(candidate.shape, limits, problem.workload.model.num_layers, problem.stock_layouts_only)
            self._caps[index] = limits if fits else None
        return self._caps[index]

    def _seed(self, budget: Budget) -> None:
        """The even split of the best-bounded candidates: a cheap first incumbent (past the
        deadline, only until there is one)."""
        num_layers = self._problem.workload.model.num_layers
        for index in range(min(len(self._candidates), self._problem.config.seed_candidates)):
            if self._best is not None and budget.expired():
                return
            limits = self._memory_caps(index)
            split = even_split(self._candidates[index].shape.pp, num_layers)
            if limits is not None and _fits(split, limits, self._problem.stock_layouts_only):
                self._offer(index, split)
            budget.charge(Work.SEED)

    def _offer(self, index: int, split: tuple[int, ...]) -> None:
        value = evaluate(self._candidates[index], split).iteration_ms
        if self._best is None or value < self._best[0]:
            self._best = (value, index, split)

    def step(self, budget: Budget) -> None:
        """Solve the split of the next candidate (skipped when no split fits memory)."""
        index = self._next
        self._next += 1
        limits = self._memory_caps(index)
        if limits is None:
            return
        problem = self._problem
        candidate = self._candidates[index]
        result = solve_split(candidate, limits, problem.workload.model.num_layers, problem.stock_layouts_only,
                             budget, problem.random_seed)
        self._solved += 1
        if result is None:
            return
        if not result.optimal:
            self._bound = min(self._bound, result.bound_ms)
        self._offer(index, result.layers_per_stage)

    def result(self) -> SearchResult | None:
        """The best layout so far, its bound over everything not solved; None if none fits."""
        if self._best is None:
            return None
        value, index, split = self._best
        bound = min(self._bound, value, self.next_bound_ms())
        optimal = bound >= value * (1 - self._problem.config.prune_tolerance)
        return SearchResult(
            candidate=self._candidates[index],
            layers_per_stage=split,
            estimate=evaluate(self._candidates[index], split),
            objective_ms=value,
            bound_ms=value if optimal else bound,
            optimal=optimal,
            wall_time_s=time.monotonic() - self._started,
            candidates_total=len(self._candidates),
            candidates_solved=self._solved,
        )


def search(problem: PlanningProblem, budget: Budget | None = None) -> SearchResult:
    """The best uniform layout found by the budget's deadline (default: `time_limit_s` from now);
    past it, the search goes on only until it has a first layout."""
    budget = budget or Budget.starting_now(problem.time_limit_s)
    uniform = UniformSearch(problem, budget)
    # Past the deadline, less what the best layout's timelines take to simulate and send, only until
    # there is a first layout.
    while uniform.next_bound_ms() < uniform.best_ms * (1 - problem.config.prune_tolerance) and not (
        uniform.best_ms < float("inf") and budget.remaining_s() <= ops_cost_s(uniform.best_timeline_ops())
    ):
        uniform.step(budget)
    result = uniform.result()
    if result is None:
        raise InfeasibleError(explain_infeasible(problem))
    return result
