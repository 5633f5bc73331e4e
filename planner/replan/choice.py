"""Replanning a running job: the best layout for the failure state now, counting what moving costs.

Objective: iteration time plus the migration time amortized over
`amortize_iterations` (the iterations the new layout is expected to run
before the next change). Candidates:

- `replan`: the planner's optimum for the new failure state (the layout
  search itself is migration-agnostic), placed by `placement.py` on the
  devices that already hold most of its state. The placement is a
  cost-neutral relabelling, so this candidate has the optimum's iteration time
  and the fewest bytes among its equivalent placements.
- `keep`: the running layout, when every device it uses is alive; nothing
  moves. Its iteration time is the one predicted when it was planned plus
  what the devices it uses have slowed down since (`keep_iteration_bound_s`):
  exact when nothing it uses changed, an upper bound otherwise, so keeping is
  never chosen on an optimistic guess.

`scratch` (the optimum where the planner places it, ignoring the running
layout) is reported for comparison and never chosen: it iterates exactly as
fast as `replan` and moves at least as many bytes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from cost_models.device import device_id, device_order
from cost_models.layout import nvlink_group_gb_s
from cost_models.migration import Holding, UnitParams, unit_params
from cost_models.transfers import MigrationCost, migration_cost
from planner.budget import Budget
from planner.plan import plan
from planner.problem import PlanningProblem
from planner.replan.holdings import (
    PlacedLayout,
    PlanShape,
    device_holdings,
    placed_layout,
)
from planner.replan.placement import matched_device_map, relabel
from planner.result import PlanResult

DEFAULT_AMORTIZE_ITERATIONS = 500


@dataclass(frozen=True)
class RunningPlan:
    """The layout the job runs now and what it was planned with.

    speeds: the speed the plan assumed for each slow device it knew of (others 1.0).
    stage_busy_ms: per replica, per stage, its busy time per iteration (microbatches x (forward +
        backward); the backward includes the weight-gradient part).
    optimizer_s: the optimizer step's share of the iteration.
    """

    layout: PlacedLayout
    iteration_s: float
    speeds: Mapping[str, float]
    stage_busy_ms: tuple[tuple[float, ...], ...] = ()
    optimizer_s: float = 0.0


def running_plan(plan: PlanShape, slow: Mapping[str, float]) -> RunningPlan:
    """From a PlanResult or API.md's Plan (whose stages also carry `forward_ms`, `backward_ms` and whose
    replicas `num_microbatches`, and a `predicted` iteration), with the slow devices it knew of."""
    replicas = sorted(plan.replicas, key=lambda r: r.id)
    busy = tuple(
        tuple(r.num_microbatches * (s.forward_ms + s.backward_ms) for s in r.stages)
        for r in replicas
    )
    breakdown = plan.predicted.breakdown  # a dict in a PlanResult, a model in a wire Plan
    optimizer_s = breakdown.get("optimizer_s") if isinstance(breakdown, Mapping) else getattr(breakdown, "optimizer_s", None)
    return RunningPlan(placed_layout(plan), plan.predicted.iteration_time_s, dict(slow), busy, optimizer_s or 0.0)


@dataclass(frozen=True)
class ReplanCandidate:
    name: str
    iteration_s: float
    migration: MigrationCost
    objective_ms: float


@dataclass(frozen=True)
class ReplanResult:
    """result is None when keeping the running layout is best."""

    result: PlanResult | None
    migration: MigrationCost
    amortize_iterations: int
    candidates: tuple[ReplanCandidate, ...]

    @property
    def chosen(self) -> ReplanCandidate:
        # On a tie keeping wins: no restart of the trainer's process groups at all.
        return min(self.candidates, key=lambda c: (c.name == "scratch", c.objective_ms, c.name != "keep"))


def objective_ms(iteration_s: float, migration: MigrationCost, amortize_iterations: int) -> float:
    return iteration_s * 1e3 + migration.estimated_s * 1e3 / amortize_iterations


def keep_iteration_bound_s(problem: PlanningProblem, running: RunningPlan) -> float | None:
    """An upper bound on the running layout's iteration time now; None when a device it uses failed.

    With the schedule's op order fixed, the makespan is a longest path through the ops, so it grows
    by at most the time added to them: a stage planned at speed s_then whose slowest device now runs
    at s_now adds at most (s_then / s_now - 1) x its busy time, and each replica by the sum over its
    stages. The optimizer step grows by at most the largest such factor. Faster devices are credited
    nothing, so the bound is the planned time when nothing the plan uses got slower.
    """
    cluster = problem.cluster
    worst_replica_s, worst_factor = 0.0, 1.0
    for index, stages in enumerate(running.layout.replicas):
        added_s = 0.0
        for position, stage in enumerate(stages):
            then, now = 1.0, 1.0
            for device in stage.devices:
                node, gpu = device_order(device)
                if (node, gpu) in cluster.failed:
                    return None
                then = min(then, running.speeds.get(device, 1.0))
                now = min(now, cluster.speed_of(node, gpu))
            factor = then / now
            if factor > 1.0:
                worst_factor = max(worst_factor, factor)
                busy_ms = running.stage_busy_ms[index][position] if running.stage_busy_ms else running.iteration_s * 1e3
                added_s += (factor - 1.0) * busy_ms / 1e3
        worst_replica_s = max(worst_replica_s, added_s)
    return running.iteration_s + worst_replica_s + (worst_factor - 1.0) * running.optimizer_s


def migration_between(problem: PlanningProblem, held: Mapping[str, Holding],
                      needed: Mapping[str, Holding]) -> MigrationCost:
    """What moving from `held` to `needed` costs on this cluster in its failure state now."""
    cluster = problem.cluster
    devices = [(n, g) for n in range(cluster.num_nodes) for g in range(cluster.gpus_per_node)]
    alive = frozenset(device_id(n, g) for n, g in devices if (n, g) not in cluster.failed)
    node_of = {device_id(n, g): n for n, g in devices}
    hardware = problem.hardware
    return migration_cost(held, needed, alive, node_of, problem_units(problem), hardware.intra_node_bandwidth_gb_s,
                          hardware.inter_node_bandwidth_gb_s, peer_link_gb_s=nvlink_group_gb_s(hardware, 2))


def problem_units(problem: PlanningProblem) -> UnitParams:
    """The model's parameters per unit, and its optimizer state's bytes a parameter as this job keeps it."""
    return unit_params(problem.workload.model, problem.software.master_weights)


def plan_migration(problem: PlanningProblem, old: PlanShape, new: PlanShape) -> MigrationCost:
    """Moving from plan `old` to plan `new` (PlanResults or wire Plans)."""
    return migration_between(problem, device_holdings(placed_layout(old)), device_holdings(placed_layout(new)))


def replan(problem: PlanningProblem, running: RunningPlan,
           amortize_iterations: int = DEFAULT_AMORTIZE_ITERATIONS, budget: Budget | None = None) -> ReplanResult:
    """The candidates weighed by the deadline of `budget` (default: `time_limit_s` from now); the
    planner gets all but the placement's share of it."""
    budget = budget or Budget.starting_now(problem.time_limit_s)
    cluster = problem.cluster
    units = problem_units(problem)
    held = device_holdings(running.layout)

    def cost_of(result: PlanResult) -> MigrationCost:
        return migration_between(problem, held, device_holdings(placed_layout(result)))

    def candidate(name: str, iteration_s: float, migration: MigrationCost) -> ReplanCandidate:
        return ReplanCandidate(name, iteration_s, migration, objective_ms(iteration_s, migration, amortize_iterations))

    started = time.monotonic()
    scratch = plan(problem, budget.share(1 - problem.config.placement_time_share))
    placed = relabel(scratch, matched_device_map(scratch, cluster, held, units, problem.config))
    placed = replace(placed, solver=replace(placed.solver, wall_time_s=round(time.monotonic() - started, 3)))
    iteration_s = scratch.predicted.iteration_time_s
    candidates = [candidate("replan", iteration_s, cost_of(placed)), candidate("scratch", iteration_s, cost_of(scratch))]
    keep_s = keep_iteration_bound_s(problem, running)
    if keep_s is not None:
        candidates.append(candidate("keep", keep_s, MigrationCost(0, 0, (), 0.0)))
    result = ReplanResult(None, candidates[0].migration, amortize_iterations, tuple(candidates))
    chosen = result.chosen
    return ReplanResult(placed if chosen.name == "replan" else None, chosen.migration, amortize_iterations,
                        tuple(candidates))
