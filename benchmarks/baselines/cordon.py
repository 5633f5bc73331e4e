"""Cordon and restart: today's practice.

Every node holding a failed or slow GPU is cordoned off, all of its GPUs
lost; the job restarts with the best uniform layout on the remaining healthy
nodes (`planner.plan.plan_uniform` on a problem with that many nodes and no
failures). Healthy nodes are interchangeable, so renumbering them changes
nothing.
"""

from __future__ import annotations

from dataclasses import replace

from benchmarks.baselines.common import BaselineResult, make_result
from planner.errors import InfeasibleError
from planner.plan import plan_uniform
from planner.problem import PlanningProblem
from planner.result import PlanResult

NAME = "cordon"


def run(problem: PlanningProblem, healthy: PlanResult | None = None) -> BaselineResult:
    """`healthy` (resiplan's healthy-cluster plan) is not needed here; accepted for a common signature."""
    cluster = problem.cluster
    remaining = cluster.num_nodes - len(cluster.damaged_nodes)
    if remaining < 1:
        raise InfeasibleError("cordon: every node holds a failed or slow GPU")
    reduced = replace(problem, cluster=replace(cluster, num_nodes=remaining, failed=frozenset(), slow=()))
    result = plan_uniform(reduced)
    stages = result.replicas[0].stages
    gpus = sum(len(s.devices) for r in result.replicas for s in r.stages)
    description = (
        f"{len(cluster.damaged_nodes)} nodes cordoned; tp={stages[0].tp} pp={len(stages)} dp={len(result.replicas)} "
        f"mbs={result.micro_batch_size} {result.schedule} v={result.virtual_stages} {result.recompute}"
    )
    return make_result(problem, NAME, result.solver.objective_ms, gpus, description)
