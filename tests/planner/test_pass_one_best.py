"""Pass 1 of a failure-aware plan (`planner.plan._plan_layout`) answers with the better of its two searches' layouts.

The non-uniform search keeps a layout when it beats the best known at that moment; the uniform search can beat it
afterwards. Best-bound order happens not to get there on the benchmark requests, but any order of the same search
must answer alike. Refined in the order pass 3 uses (an outer choice whose allocation could beat the best layout is
settled before the queue's front), 32 H100 with three slow GPUs (qwen2.5-32b, batch 256 x 8,192) reach a
non-uniform layout at 34,459 ms first and the uniform search then finds 31,166 ms; pass 1 answered with the first.
"""

from __future__ import annotations

import heapq

import pytest

import planner.plan
from planner.budget import Budget
from planner.nonuniform.search import NonUniformSearch
from planner.plan import _plan_layout
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


class _DivingSearch(NonUniformSearch):
    """The same search, every outer choice with an allocation still open refined before the queue's front."""

    def step(self, budget: Budget, incumbent_ms: float = float("inf")) -> None:
        super().step(budget, incumbent_ms)
        opened = [entry for entry in self._queue if entry[0] < float("inf") and entry[1] in self._searches]
        if opened:
            self._queue = [entry for entry in self._queue if entry[1] not in self._searches]
            heapq.heapify(self._queue)
            for entry in opened:
                heapq.heappush(self._dives, entry)


@pytest.mark.parametrize("diving", [False, True], ids=["best-bound order", "diving order"])
def test_pass_one_answers_no_worse_than_the_uniform_search(monkeypatch: pytest.MonkeyPatch, diving: bool) -> None:
    problem = to_problem(PlanRequest.model_validate(REQUEST))
    uniform_ms = search(problem).objective_ms  # the uniform space alone, searched to the end
    if diving:
        monkeypatch.setattr(planner.plan, "NonUniformSearch", _DivingSearch)
    budget = Budget.unlimited()
    layout = _plan_layout(problem, budget, ranked_candidates(problem, budget), {}, [])
    assert layout.solver.objective_ms <= uniform_ms * (1 + 1e-9), (layout.solver.objective_ms, uniform_ms)
