"""CP-SAT model: the best contiguous layer split of one candidate shape.

Minimizes the iteration time of `cost_models.iteration` exactly (up to the
time quantum): for every replica speed vector r, the pipeline time
m * max_i t_ri + (sum_i t_ri - max_i t_ri) / v, the worst replica counting;
plus the largest exposed gradient sync and the largest optimizer step; every
stage fitting in GPU memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ortools.sat.python import cp_model

from cost_models.iteration import stage_time
from planner.budget import Budget
from planner.config import TIME_QUANTUM_MS
from planner.cp_sat import new_solver
from planner.uniform.candidates import Candidate
from planner.work import Work

# Probe size for reading the slope of the affine gradient-sync time.
_SYNC_PROBE_PARAMS = 1e9


def _ticks(ms: float) -> int:
    return round(ms / TIME_QUANTUM_MS)


@dataclass(frozen=True)
class SplitResult:
    layers_per_stage: tuple[int, ...]
    objective_ms: float
    bound_ms: float
    optimal: bool
    status: str


@dataclass(frozen=True)
class Affine:
    """value(n) = per_layer * n + fixed (ticks or parameter quanta)."""

    per_layer: int
    fixed: int


def _stage_affine(candidate: Candidate, stage: int, speed: float, attribute: str) -> Affine:
    zero = getattr(stage_time(candidate.terms, stage, 0, speed), attribute)
    one = getattr(stage_time(candidate.terms, stage, 1, speed), attribute)
    return Affine(_ticks(one - zero), _ticks(zero))


def _sync_ms_affine(collective_ms: Callable[[float], float]) -> tuple[float, float]:
    """A data-parallel collective's time (`StageCostTerms.dp_sync_ms`, `.param_gather_ms`) =
    slope_ms_per_param * params + intercept_ms, for a positive parameter count."""
    low, high = collective_ms(_SYNC_PROBE_PARAMS), collective_ms(2 * _SYNC_PROBE_PARAMS)
    slope = (high - low) / _SYNC_PROBE_PARAMS
    return slope, low - slope * _SYNC_PROBE_PARAMS


def _end_params(candidate: Candidate, stage: int) -> float:
    terms = candidate.terms
    last = terms.shape.pp - 1
    return (terms.embedding.params if stage == 0 else 0.0) + (terms.head.params if stage == last else 0.0)


def _per_param_affine(candidate: Candidate, stage: int, ms_per_param: float, intercept_ms: float) -> Affine:
    """Ticks of a time linear in the stage's parameters per GPU."""
    return Affine(
        _ticks(ms_per_param * candidate.terms.layer.params),
        _ticks(ms_per_param * _end_params(candidate, stage) + intercept_ms),
    )


def solve_split(
    candidate: Candidate,
    max_layers: tuple[int, ...],
    num_layers: int,
    stock_layouts_only: bool,
    budget: Budget,
    random_seed: int,
) -> SplitResult | None:
    """Optimal split for `candidate`, or None if no split fits (or none is found by the budget's end, which
    is charged the model and CP-SAT's deterministic time)."""
    terms = candidate.terms
    p, m, v = terms.shape.pp, terms.num_microbatches, terms.shape.virtual_stages
    model = cp_model.CpModel()

    # Data: stage time per microbatch for each replica speed vector, forward
    # and backward time at full speed, gradient sync, weight all-gather
    # (ZeRO-1) and optimizer step, all affine in the stage's layer count, in ticks.
    times = [[_stage_affine(candidate, i, speeds[i], "total_ms") for i in range(p)] for speeds in candidate.replica_speeds]
    even = [num_layers // p + (1 if i < num_layers % p else 0) for i in range(p)]
    backward = [_stage_affine(candidate, i, 1.0, "backward_ms") for i in range(p)]
    forward = [_stage_affine(candidate, i, 1.0, "forward_ms") for i in range(p)]
    sync_slope, sync_intercept = _sync_ms_affine(terms.dp_sync_ms)
    sync = [_per_param_affine(candidate, i, sync_slope, sync_intercept) for i in range(p)]
    bucket_sync = _ticks(terms.dp_sync_ms(terms.bucket_params))
    gather_slope, gather_intercept = _sync_ms_affine(terms.param_gather_ms)
    gather = [_per_param_affine(candidate, i, gather_slope, gather_intercept) for i in range(p)]
    bucket_gather = _ticks(terms.param_gather_ms(terms.bucket_params))
    step = [_per_param_affine(candidate, i, terms.optimizer_ms_per_param, 0.0) for i in range(p)]
    stage_horizon = max(a.per_layer * num_layers + a.fixed for row in times for a in row)
    sync_horizon = max(a.per_layer * num_layers + a.fixed for a in sync + gather + step)
    horizon = (m * v + p) * stage_horizon + v * sync_horizon

    # Variables: layers per stage, at most what fits in memory.
    layers = [model.new_int_var(1, min(num_layers, max_layers[i]), f"layers_{i}") for i in range(p)]
    pipeline = model.new_int_var(0, horizon, "pipeline_times_v")
    exposed = model.new_int_var(0, horizon, "dp_exposed")
    optimizer = model.new_int_var(0, horizon, "optimizer")

    # Cover: the stages hold [0, L) contiguously.
    model.add(sum(layers) == num_layers)
    for n, hint in zip(layers, even):
        model.add_hint(n, hint)

    # Split form: interleaving needs equal chunks; stock frameworks take equal
    # middle stages with only the first and last stage uneven.
    if v > 1:
        for n in layers:
            model.add(n == num_layers // p)
    elif stock_layouts_only and p > 3:
        for n in layers[2:-1]:
            model.add(n == layers[1])

    # Pipeline: per replica, v * time = (m v - 1) * slowest stage + sum of stages.
    for r, replica_times in enumerate(times):
        slowest = model.new_int_var(0, stage_horizon, f"slowest_{r}")
        totals = []
        for i, affine in enumerate(replica_times):
            total = model.new_int_var(0, stage_horizon, f"stage_{r}_{i}")
            model.add(total == affine.per_layer * layers[i] + affine.fixed)
            model.add(total <= slowest)
            totals.append(total)
        model.add(pipeline >= (m * v - 1) * slowest + sum(totals))

    # Gradient sync: per stage, exposed >= the reduction left after its last
    # backward plus the weight all-gather left before its first forward
    # (`cost_models.iteration.exposed_dp_sync_ms`). Each part is at least its
    # collective minus the compute it overlaps, and at least one bucket's,
    # min(collective, one bucket's); without the overlap, all of it.
    if terms.shape.grad_sync_ranks > 1:
        overlaps = ((sync, backward, bucket_sync, terms.overlap_grad_reduce, "reduce"),
                    (gather, forward, bucket_gather, terms.overlap_param_gather, "gather"))
        for i in range(p):
            parts = []
            for collective, compute, bucket, overlapped, name in overlaps:
                if collective[i].per_layer == 0 and collective[i].fixed <= 0:
                    continue  # no weight all-gather without ZeRO-1
                whole = model.new_int_var(0, horizon, f"{name}_{i}")
                model.add(whole == collective[i].per_layer * layers[i] + collective[i].fixed)
                if not overlapped:
                    parts.append(whole)
                    continue
                left = model.new_int_var(0, horizon, f"{name}_exposed_{i}")
                model.add(left >= whole - compute[i].per_layer * layers[i] - compute[i].fixed)
                least = model.new_int_var(0, horizon, f"{name}_least_{i}")
                model.add_min_equality(least, [whole, bucket])
                model.add(left >= least)
                parts.append(left)
            model.add(exposed >= sum(parts))

    # Optimizer: the stage with the most parameters per GPU sets the step time.
    for i in range(p):
        model.add(optimizer >= step[i].per_layer * layers[i] + step[i].fixed)

    # Objective: v * iteration time.
    model.minimize(pipeline + v * (exposed + optimizer))

    # Presolve can spend tens of seconds on these few-variable models with large tick-valued
    # coefficients (seen: 25 s vs 0.01 s without it, same optimum).
    solver = new_solver(budget.remaining_s(), random_seed, presolve=False)
    status = solver.solve(model)
    budget.charge(Work.CP_SAT, solver.deterministic_time)
    budget.charge(Work.SPLIT_MODEL)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    scale = TIME_QUANTUM_MS / v
    return SplitResult(
        layers_per_stage=tuple(solver.value(n) for n in layers),
        objective_ms=solver.objective_value * scale,
        bound_ms=solver.best_objective_bound * scale,
        optimal=status == cp_model.OPTIMAL,
        status=solver.status_name(status),
    )
