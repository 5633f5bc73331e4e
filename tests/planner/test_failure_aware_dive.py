"""At scale the simulation-floor search must value the layouts whose floors beat the answer, not only raise its bound.

256 A100-80GB, llama2-7b, batch 512 x 4,096, one GPU lost. The bubble-model searches answer with tp 2, pp 2,
4 chunks per stage over 62 pipelines; the floor-priced search (pass 3 of `planner.plan`) then has 4,000+ outer
choices whose floors sit 10-25% below that answer, and best-bound order spends its whole step budget raising the
bound over them: it planned 2.1737 s and never valued the one allocation that beats it. Written out by hand, that
layout is 41 three-stage pipelines of TP pairs (layers 11, 11, 10) taking 12 or 13 microbatches each, priced
through `/v1/estimate` with ZB-H2: 2.1153 s. With the dive (an outer choice whose allocation floor beats the best
layout is refined before the queue's front) the plan is at least as fast as that layout, and its bound stays below
it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import planner.plan
from api.tasks.planning import estimate_for, plan_for
from planner.budget import Budget
from planner.plan import plan
from planner.result import PlanResult
from wire.convert import to_problem
from wire.schemas import EstimateRequest, PlanRequest

NODES, GPUS_PER_NODE = 32, 8
REQUEST = {
    "cluster": {"num_nodes": NODES, "gpus_per_node": GPUS_PER_NODE, "gpu": "A100-80GB"},
    "failures": {"failed": ["1:0"]},
    "model": "llama2-7b",
    "training": {"global_batch_size": 512, "seq_length": 4096},
}
SPLIT = ((0, 11), (11, 22), (22, 32))
PIPELINES = 41  # 21 take 12 microbatches, 20 take 13: 512 in all


def _witness(schedule: str) -> dict:
    """Every pipeline's stages on consecutive healthy GPU pairs, node by node, the failed GPU's pair left out."""
    pairs = [[f"{node}:{gpu}", f"{node}:{gpu + 1}"] for node in range(NODES) for gpu in range(0, GPUS_PER_NODE, 2)
             if (node, gpu) != (1, 0)]
    replicas = [{"num_microbatches": 12 if r < 21 else 13,
                 "stages": [{"devices": pairs[3 * r + s], "layers": list(SPLIT[s])} for s in range(3)]}
                for r in range(PIPELINES)]
    assert sum(r["num_microbatches"] for r in replicas) == 512
    return {"micro_batch_size": 1, "schedule": schedule, "recompute": "none", "replicas": replicas}


def test_the_plan_is_at_least_as_fast_as_a_layout_the_floors_admit() -> None:
    plan = plan_for(PlanRequest.model_validate(REQUEST))
    witness = estimate_for(EstimateRequest.model_validate({**REQUEST, "layout": _witness("zb-h2")}))
    witness_ms = witness.predicted.iteration_time_s * 1e3
    assert plan.predicted.iteration_time_s * 1e3 <= witness_ms * (1 + 1e-6), witness_ms
    assert plan.solver.bound_ms <= witness_ms * (1 + 1e-6), (plan.solver.bound_ms, witness_ms)


def test_of_two_candidates_the_faster_once_scheduled_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """List and CP-SAT schedules lower layouts by different shares (llama2-70b on 256 A100, 8 GPUs lost: layouts
    valued 20.44 and 20.62 s ended at 20.29 and 19.89 s), so the runner-up by handcrafted value is scheduled too.
    Here the schedules step is replaced by fixed outcomes: scheduling only the better-valued layout answers 3.0 s."""
    small = {"cluster": {"num_nodes": 1, "gpus_per_node": 4, "gpu": "A100-80GB"}, "model": "llama2-7b",
             "training": {"global_batch_size": 8, "seq_length": 1024}}
    problem = to_problem(PlanRequest.model_validate(small))
    layout = plan(problem)

    def valued_at(seconds: float) -> PlanResult:
        return replace(layout, predicted=replace(layout.predicted, iteration_time_s=seconds))

    better_valued, runner_up = valued_at(2.0), valued_at(2.1)
    scheduled_s = {id(better_valued): 3.0, id(runner_up): 2.5}
    monkeypatch.setattr(planner.plan, "with_schedules",
                        lambda problem, result, work, optional_s: valued_at(scheduled_s[id(result)]))
    answer = planner.plan._best_scheduled(problem, [(2100.0, runner_up), (2000.0, better_valued)],
                                          Budget.starting_now(30).as_work(), 30.0)
    assert answer.predicted.iteration_time_s == 2.5
