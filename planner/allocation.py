"""CP-SAT model: which TP groups damaged nodes form, which replicas to build, how many microbatches each runs.

Given one outer choice and its templates (pipelines with fixed splits), the
iteration is  pipeline + tail,  where the pipeline is the busiest replica's
(q v - 1) M_t + S_t (over v) and the tail is the largest exposed gradient sync
(resharded once replicas differ) plus the largest optimizer step.

For a fixed pipeline budget P every template's per-replica capacity
cap_t(P) = floor((P + M_t - S_t) / (v M_t)) is a constant, so choosing
  - per class of alike damaged nodes, how many take each partition into TP groups,
  - per template, how many replicas n_t,
with sum_t n_t cap_t(P) >= N microbatches and the least tail is a linear
CP-SAT model. Feasibility grows with P, so the least feasible P is found by
bisection over the breakpoints (q v - 1) M_t + S_t; the optimum is the least
P/v + tail(P) over the breakpoints from there up to one tail further, which
is scanned exactly.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from ortools.linear_solver import pywraplp
from ortools.sat.python import cp_model

from planner.partitions import NodeClass, Partition, StageType
from planner.templates import Template

TIME_QUANTUM_MS = 1e-3


def _ticks(ms: float) -> int:
    return round(ms / TIME_QUANTUM_MS)


@dataclass(frozen=True)
class AllocationInput:
    templates: list[Template]
    base: StageType
    healthy_base_groups: int  # base groups on undamaged nodes
    classes: list[NodeClass]
    partitions: list[list[Partition]]  # per class
    microbatches: int  # N = global batch / micro-batch size
    virtual_stages: int
    min_replicas: int  # ZeRO-1 memory was computed for at least this many replicas


@dataclass(frozen=True)
class Allocation:
    replicas_per_template: tuple[int, ...]
    microbatches_per_template: tuple[int, ...]
    partition_counts: tuple[tuple[int, ...], ...]  # per class, per partition
    objective_ms: float
    bound_ms: float
    optimal: bool
    status: str


@dataclass(frozen=True)
class _Fixed:
    replicas: tuple[int, ...]
    partition_counts: tuple[tuple[int, ...], ...]
    tail_ticks: int
    optimal: bool


def _capacity(template: Template, budget: int, v: int) -> int:
    """Most microbatches one replica of `template` runs within `budget` (v * ticks)."""
    bottleneck, total = _ticks(template.bottleneck_ms), _ticks(template.total_ms)
    if budget + bottleneck - total < v * bottleneck:
        return 0
    return (budget + bottleneck - total) // (v * bottleneck)


def _solve_fixed_budget(
    data: AllocationInput, budget: int, time_limit_s: float, solver: cp_model.CpSolver, minimize_tail: bool = True
) -> _Fixed | None:
    """Least tail with every template's replicas within `budget` (any allocation when not
    `minimize_tail`); None if the budget is too small."""
    templates, v, total = data.templates, data.virtual_stages, data.microbatches
    capacities = [_capacity(t, budget, v) for t in templates]
    usable = [k for k, c in enumerate(capacities) if c > 0]
    if not usable:
        return None
    model = cp_model.CpModel()

    # Data: group supplies per partition, demands per template, tails in ticks.
    supply = [[p.counts() for p in ps] for ps in data.partitions]
    degraded_types = sorted({st for k in usable for st, _ in templates[k].degraded})
    most_groups = data.healthy_base_groups + sum(
        len(c.nodes) * max((len(p.groups) for p in ps), default=0) for c, ps in zip(data.classes, data.partitions)
    )
    tail_horizon = max(_ticks(max(t.sync_uniform_ms, t.sync_resharded_ms)) + _ticks(t.optimizer_ms) for t in templates)

    # Variables: partitions per class, replicas per usable template, used flags, tail parts.
    chosen = [[model.new_int_var(0, len(c.nodes), f"class{ci}_partition{pi}") for pi in range(len(ps))]
              for ci, (c, ps) in enumerate(zip(data.classes, data.partitions))]
    replicas = {k: model.new_int_var(0, min(total, most_groups // len(templates[k].stage_types)), f"replicas_{k}")
                for k in usable}
    used = {k: model.new_bool_var(f"used_{k}") for k in usable}
    mixed = model.new_bool_var("mixed")
    sync = model.new_int_var(0, tail_horizon, "sync")
    optimizer = model.new_int_var(0, tail_horizon, "optimizer")

    # Partitions: every damaged node takes exactly one.
    for ci, c in enumerate(data.classes):
        model.add(sum(chosen[ci]) == len(c.nodes))

    # Groups: replicas use no more groups of a type than the nodes form.
    for st in degraded_types:
        made = sum(chosen[ci][pi] * counts[st] for ci, row in enumerate(supply) for pi, counts in enumerate(row) if counts[st])
        needed = sum(replicas[k] * templates[k].degraded_map.get(st, 0) for k in usable if templates[k].degraded_map.get(st, 0))
        model.add(needed <= made)
    base_made = data.healthy_base_groups + sum(
        chosen[ci][pi] * counts[data.base] for ci, row in enumerate(supply) for pi, counts in enumerate(row) if counts[data.base]
    )
    model.add(sum(replicas[k] * templates[k].base_groups for k in usable) <= base_made)

    # Microbatches: capacity covers all N; every replica runs at least one.
    model.add(sum(replicas[k] * capacities[k] for k in usable) >= total)
    model.add(sum(replicas.values()) <= total)
    model.add(sum(replicas.values()) >= data.min_replicas)
    for k in usable:
        model.add(replicas[k] >= 1).only_enforce_if(used[k])
        model.add(replicas[k] == 0).only_enforce_if(~used[k])

    # Tail: resharded sync once replicas differ in TP or stage boundaries; the largest optimizer step.
    shardings: dict[tuple, list[int]] = {}
    for k in usable:
        shardings.setdefault(templates[k].sharding, []).append(k)
    sharding_used = []
    for members in shardings.values():
        flag = model.new_bool_var("")
        model.add_max_equality(flag, [used[k] for k in members])
        sharding_used.append(flag)
    model.add(sum(sharding_used) >= 2).only_enforce_if(mixed)
    model.add(sum(sharding_used) <= 1).only_enforce_if(~mixed)
    for k in usable:
        t = templates[k]
        model.add(sync >= _ticks(t.sync_uniform_ms)).only_enforce_if(used[k])
        model.add(sync >= _ticks(t.sync_resharded_ms)).only_enforce_if([used[k], mixed])
        model.add(optimizer >= _ticks(t.optimizer_ms)).only_enforce_if(used[k])

    # Objective: the least tail.
    if minimize_tail:
        model.minimize(sync + optimizer)

    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return _Fixed(
        replicas=tuple(solver.value(replicas[k]) if k in replicas else 0 for k in range(len(templates))),
        partition_counts=tuple(tuple(solver.value(x) for x in row) for row in chosen),
        tail_ticks=solver.value(sync) + solver.value(optimizer),
        optimal=status == cp_model.OPTIMAL,
    )


def _capacity_upper_bound(data: AllocationInput, capacities: list[int]) -> float:
    """Most microbatches any allocation can run: every group earns at most the best
    capacity-per-stage of a template using its type; each damaged node its best partition."""
    per_group: dict[StageType, float] = {}
    for template, capacity in zip(data.templates, capacities):
        if capacity <= 0:
            continue
        share = capacity / len(template.stage_types)
        for stage_type in set(template.stage_types):
            per_group[stage_type] = max(per_group.get(stage_type, 0.0), share)
    bound = data.healthy_base_groups * per_group.get(data.base, 0.0)
    for node_class, partitions in zip(data.classes, data.partitions):
        best = max((sum(per_group.get(g, 0.0) for g in p.groups) for p in partitions), default=0.0)
        bound += len(node_class.nodes) * best
    return bound


def _breakpoints_between(templates: list[Template], v: int, total: int, lowest: float, highest: float) -> set[int]:
    """Budgets (q v - 1) M + S, q = 1..N, of every template within [lowest, highest)."""
    out: set[int] = set()
    for t in templates:
        bottleneck, fill = _ticks(t.bottleneck_ms), _ticks(t.total_ms) - _ticks(t.bottleneck_ms)
        step = v * bottleneck
        first = 1 if lowest <= step + fill else max(1, int((lowest - fill) // step))
        for q in range(first, total + 1):
            budget = q * step + fill
            if budget >= highest:
                break
            if budget >= lowest:
                out.add(budget)
    return out


def _relaxed_capacity(data: AllocationInput, capacities: list[int]) -> float:
    """LP relaxation (GLOP) of the most microbatches any allocation runs within the budget:
    replica and partition counts continuous, the same group supplies. An upper bound."""
    solver = pywraplp.Solver.CreateSolver("GLOP")
    usable = [k for k, c in enumerate(capacities) if c > 0]
    if not usable:
        return 0.0
    replicas = {k: solver.NumVar(0, data.microbatches, f"replicas_{k}") for k in usable}
    chosen = [[solver.NumVar(0, len(c.nodes), "") for _ in ps] for c, ps in zip(data.classes, data.partitions)]
    for ci, c in enumerate(data.classes):
        solver.Add(sum(chosen[ci]) == len(c.nodes))
    supply = [[p.counts() for p in ps] for ps in data.partitions]
    types = {st for k in usable for st, _ in data.templates[k].degraded} | {data.base}
    for st in types:
        made = sum(chosen[ci][pi] * counts[st] for ci, row in enumerate(supply) for pi, counts in enumerate(row) if counts[st])
        if st == data.base:
            made = made + data.healthy_base_groups
            needed = sum(replicas[k] * data.templates[k].base_groups for k in usable)
        else:
            needed = sum(replicas[k] * data.templates[k].degraded_map.get(st, 0) for k in usable if data.templates[k].degraded_map.get(st, 0))
        solver.Add(needed <= made)
    solver.Add(sum(replicas.values()) <= data.microbatches)
    solver.Maximize(sum(replicas[k] * capacities[k] for k in usable))
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return float("inf")  # no proof of infeasibility: let CP-SAT decide
    return solver.Objective().Value()


def _healthy_nodes_suffice(data: AllocationInput, capacities: list[int]) -> bool:
    """Whether replicas of one base-only template on undamaged nodes alone run all N microbatches."""
    for template, capacity in zip(data.templates, capacities):
        if template.degraded or capacity <= 0:
            continue
        replicas = min(data.healthy_base_groups // len(template.stage_types), data.microbatches)
        if replicas >= data.min_replicas and replicas * capacity >= data.microbatches:
            return True
    return False


def _feasible(data: AllocationInput, budget: int, solver: cp_model.CpSolver, time_limit_s: float) -> bool:
    capacities = [_capacity(t, budget, data.virtual_stages) for t in data.templates]
    if _capacity_upper_bound(data, capacities) < data.microbatches:
        return False
    if _healthy_nodes_suffice(data, capacities):
        return True
    if _relaxed_capacity(data, capacities) < data.microbatches - 1e-6:
        return False
    return _solve_fixed_budget(data, budget, time_limit_s, solver, minimize_tail=False) is not None


def _distribute(data: AllocationInput, fixed: _Fixed, budget: int) -> tuple[int, ...]:
    """Microbatches per template: each replica one, then fill the fastest templates up to capacity."""
    v = data.virtual_stages
    work = list(fixed.replicas)
    left = data.microbatches - sum(work)
    order = sorted(range(len(data.templates)), key=lambda k: data.templates[k].bottleneck_ms)
    for k in order:
        room = fixed.replicas[k] * _capacity(data.templates[k], budget, v) - work[k]
        take = max(0, min(left, room))
        work[k] += take
        left -= take
    return tuple(work)


def solve_allocation(
    data: AllocationInput,
    time_limit_s: float,
    random_seed: int,
    floor_ms: float = 0.0,
    ceiling_ms: float = float("inf"),
) -> Allocation | None:
    """Optimal allocation, or None if none beats `ceiling_ms` (an incumbent's iteration time).

    `floor_ms`, a known lower bound on the iteration, skips budgets below it less the largest
    tail; budgets above the ceiling cannot beat the incumbent and are not tried.
    """
    templates, v, total = data.templates, data.virtual_stages, data.microbatches
    if not templates:
        return None
    deadline = time.monotonic() + time_limit_s
    largest_tail = max(_ticks(max(t.sync_uniform_ms, t.sync_resharded_ms)) + _ticks(t.optimizer_ms) for t in templates)
    shortest_tail = v * min(_ticks(t.sync_uniform_ms) + _ticks(t.optimizer_ms) for t in templates)
    lowest = v * (_ticks(floor_ms) - largest_tail)
    highest = v * _ticks(ceiling_ms) - shortest_tail if ceiling_ms < float("inf") else float("inf")
    breakpoints = sorted(_breakpoints_between(templates, v, total, lowest, highest))
    if not breakpoints:
        return None

    # One solver for every model of this allocation: building one is not free.
    solver = cp_model.CpSolver()
    solver.parameters.random_seed = random_seed
    solver.parameters.num_workers = 1
    # Small models solved many times: presolve and probing cost more than they save (measured
    # 40% faster on the sample scenarios, same optima).
    solver.parameters.cp_model_presolve = False
    solver.parameters.cp_model_probing_level = 0

    def remaining() -> float:
        return max(0.01, deadline - time.monotonic())

    def attempt(index: int) -> _Fixed | None:
        return _solve_fixed_budget(data, breakpoints[index], remaining(), solver)

    # The largest useful budget first, with the least tail: if even it is infeasible nothing here
    # beats the incumbent, and its tail is the least any smaller budget can reach.
    capacities_top = [_capacity(t, breakpoints[-1], v) for t in templates]
    if _capacity_upper_bound(data, capacities_top) < total:
        return None
    if not _healthy_nodes_suffice(data, capacities_top) and _relaxed_capacity(data, capacities_top) < total - 1e-6:
        return None
    top = attempt(len(breakpoints) - 1)
    if top is None:
        return None
    least_tail = v * top.tail_ticks
    # Bisection for the least feasible budget; bounds decide most probes without a solve.
    first = bisect.bisect_left(
        range(len(breakpoints)), True, key=lambda i: _feasible(data, breakpoints[i], solver, remaining())
    )
    # The top budget is feasible (solved above); a probe that ran out of time reads as infeasible,
    # so under load bisection can run past it.
    timed_out = first >= len(breakpoints)
    first = min(first, len(breakpoints) - 1)
    best_fixed = attempt(first) if first < len(breakpoints) - 1 else top
    if best_fixed is None:
        return None
    best_budget = breakpoints[first]
    best_value = best_budget + v * best_fixed.tail_ticks
    all_optimal = best_fixed.optimal and top.optimal and not timed_out
    # Larger budgets pay off only by a shorter tail, never shorter than the top budget's.
    for index in range(first + 1, len(breakpoints)):
        if breakpoints[index] + least_tail >= best_value or time.monotonic() >= deadline:
            all_optimal = all_optimal and breakpoints[index] + least_tail >= best_value
            break
        fixed = attempt(index) if index < len(breakpoints) - 1 else top
        if fixed is None:
            continue
        all_optimal = all_optimal and fixed.optimal
        value = breakpoints[index] + v * fixed.tail_ticks
        if value < best_value:
            best_value, best_budget, best_fixed = value, breakpoints[index], fixed
    scale = TIME_QUANTUM_MS / v
    return Allocation(
        replicas_per_template=best_fixed.replicas,
        microbatches_per_template=_distribute(data, best_fixed, best_budget),
        partition_counts=best_fixed.partition_counts,
        objective_ms=best_value * scale,
        bound_ms=(best_value if all_optimal else breakpoints[first]) * scale,
        optimal=all_optimal,
        status="OPTIMAL" if all_optimal else "FEASIBLE",
    )
