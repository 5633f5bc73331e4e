"""Pass 1 of a failure-aware plan (`planner.plan._plan_layout`): the better of its two searches' layouts, within
`bubble_search_gap` of the best over both spaces.

The non-uniform search keeps a layout when it beats the best known at that moment; the uniform search can beat it
afterwards. Refined in the order pass 1 uses (an outer choice whose allocation could beat the best layout is settled
before the queue's front), 32 H100 with three slow GPUs (qwen2.5-32b, batch 256 x 8,192) reach a non-uniform layout at
34,459 ms first and the uniform search then finds 31,166 ms; pass 1 once answered with the first. Best-bound order
happens not to get there, but any order of the same search must answer alike.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

import pytest

import planner.plan
from planner.budget import Budget
from planner.nonuniform.search import NonUniformSearch
from planner.plan import _plan_layout
from planner.problem import PlanningProblem
from planner.uniform.candidates import ranked_candidates
from planner.uniform.search import search
from wire.convert import to_problem
from wire.schemas import PlanRequest

REQUEST = {
    "cluster": {"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM"},
    "failures": {"slow": [{"device": "3:4", "speed": 0.47}, {"device": "2:4", "speed": 0.66},
                          {"device": "0:4", "speed": 0.71}]},
    "model": "qwen2.5-32b",
    "training": {"global_batch_size": 256, "seq_length": 8192},
}


class _BestBoundSearch(NonUniformSearch):
    """The same search refined strictly best bound first: no outer choice is settled before the queue's front."""

    def step(self, budget: Budget, incumbent_ms: float = float("inf")) -> None:
        super().step(budget, incumbent_ms)
        for entry in self._dives:
            heapq.heappush(self._queue, entry)
        self._dives.clear()


def _pass_one(problem: PlanningProblem) -> tuple[float, int]:
    """Pass 1's objective and how many refinements it made."""
    budget, steps = Budget.unlimited(), []
    layout = _plan_layout(problem, budget, ranked_candidates(problem, budget), {}, steps)
    return layout.solver.objective_ms, len(steps)


def _exact(problem: PlanningProblem) -> PlanningProblem:
    return replace(problem, config=replace(problem.config, bubble_search_gap=problem.config.prune_tolerance))


@pytest.mark.parametrize("order", ["diving order", "best-bound order"])
def test_pass_one_run_to_the_end_answers_no_worse_than_the_uniform_search(monkeypatch: pytest.MonkeyPatch,
                                                                           order: str) -> None:
    problem = _exact(to_problem(PlanRequest.model_validate(REQUEST)))
    uniform_ms = search(problem).objective_ms  # the uniform space alone, searched to the end
    if order == "best-bound order":
        monkeypatch.setattr(planner.plan, "NonUniformSearch", _BestBoundSearch)
    objective_ms, _ = _pass_one(problem)
    # Pass 1 reports its objective rounded to 1 us, the uniform search does not.
    assert objective_ms <= uniform_ms * (1 + 1e-9) + 5e-4, (objective_ms, uniform_ms)


def test_pass_one_stops_within_its_gap_of_the_best_over_both_spaces() -> None:
    problem = to_problem(PlanRequest.model_validate(REQUEST))
    gap = problem.config.bubble_search_gap
    exact_ms, exact_steps = _pass_one(_exact(problem))
    objective_ms, steps = _pass_one(problem)
    # Rounded to the microsecond on the wire, hence the 1e-3 ms.
    assert objective_ms <= exact_ms / (1 - gap) + 1e-3, (objective_ms, exact_ms)
    assert steps < exact_steps, (steps, exact_steps)
