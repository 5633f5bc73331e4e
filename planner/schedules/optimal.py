"""The best per-stage operation order by CP-SAT.

`optimize_schedule(spec, ...)` builds a CP-SAT model with one interval per
operation and minimizes the makespan; the per-stage orders it returns run
in the simulator (ops as early as possible in the given order) at most as
long as the model's objective, because the model's times are rounded up to
whole ticks. It starts from the best of the caller's hint and the greedy
list schedules of `list_scheduling`, and stops as soon as that meets the
lower bound of `bounds`.

Symmetry: microbatches are identical, so on every stage and chunk the
forwards (and the B, I and W ops) may be taken in microbatch order without
losing optimality (see `_build_model`). That removes the m! relabelings
the solver would otherwise have to explore, and makes a memory cap of k
in-flight microbatches a plain precedence.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from cost_models.choices import ScheduleName
from planner.cp_sat import new_solver
from planner.schedules.bounds import lower_bound_ms, sequential_ms
from planner.schedules.list_scheduling import Start, warm_starts, with_backward
from planner.schedules.ops import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    ChunkTimes,
    Op,
    PipelineSpec,
    Schedule,
    ScheduleError,
    TimedOp,
    op_kinds,
)
from planner.schedules.simulator import SimulationResult, simulate
from planner.work import PRICE_S, Work

OPTIMIZED = ScheduleName.OPTIMIZED
_MAX_HORIZON_TICKS = 10_000_000
_TICKS_PER_MS = tuple(10.0**k for k in range(-3, 4))  # 1 tick = 1 s ... 1 us


@dataclass(frozen=True)
class OptimizedSchedule:
    """The solver's order and what is known about its optimality.

    `makespan_ms` is the simulated makespan of `schedule`; `objective_ms`
    and `bound_ms` are the CP-SAT objective and best bound of the tick
    model (`objective_ms >= makespan_ms`). When `exact`, every time is a
    whole number of ticks and `bound_ms` bounds the real problem too;
    otherwise durations were rounded up and it bounds the rounded one.
    `source` says where the order comes from: "cp-sat", "hint", or the
    greedy list schedule that the solver did not improve on.
    """

    schedule: Schedule
    makespan_ms: float
    objective_ms: float
    bound_ms: float
    lower_bound_ms: float  # `lower_bound_ms(spec, split_backward=...)`
    status: str  # CP-SAT status name (OPTIMAL also when a starting point meets the bound and CP-SAT is skipped)
    wall_s: float
    ticks_per_ms: float
    exact: bool
    source: str
    deterministic_time: float = 0.0  # CP-SAT's, when it ran: the work a budget is charged for it

    @property
    def optimal(self) -> bool:
        return self.status == "OPTIMAL" and self.exact


# --------------------------------------------------------------------------- ticks


def _all_durations(spec: PipelineSpec) -> list[tuple[float, int]]:
    """Every time of the spec with the fewest ticks it may take (ops 1, so no interval is empty)."""
    values = [(spec.p2p_latency_ms, 0)]
    for row in spec.chunks:
        for t in row:
            values += [(t.forward_ms, 1), (t.input_grad_ms, 1), (t.weight_grad_ms, 1)]
    return values


def _choose_ticks_per_ms(spec: PipelineSpec, horizon_ms: float) -> tuple[float, bool]:
    """The finest power-of-ten tick (at most 1 us) keeping the horizon under 1e7 ticks; whether times are whole.

    Fine ticks also keep CP-SAT from expanding short domains into Booleans
    (at 1 tick per ms, p=8 m=32 spent the whole budget in presolve).
    """
    allowed = [k for k in _TICKS_PER_MS if horizon_ms * k <= _MAX_HORIZON_TICKS] or [_TICKS_PER_MS[0]]
    scale = allowed[-1]
    exact = all(
        abs(_ticks(x, scale, least) - x * scale) <= 1e-9 * max(1.0, x * scale) for x, least in _all_durations(spec)
    )
    return scale, exact


def _ticks(ms: float, scale: float, minimum: int) -> int:
    return max(minimum, math.ceil(round(ms * scale, 6)))


def _tick_spec(spec: PipelineSpec, scale: float) -> PipelineSpec:
    """The spec with every time rounded up to whole ticks (ops at least one tick), in tick units."""
    chunks = tuple(
        tuple(
            ChunkTimes(
                float(_ticks(t.forward_ms, scale, 1)),
                float(_ticks(t.input_grad_ms, scale, 1)),
                float(_ticks(t.weight_grad_ms, scale, 1)),
                t.activation_gib,
            )
            for t in row
        )
        for row in spec.chunks
    )
    return replace(spec, chunks=chunks, p2p_latency_ms=float(_ticks(spec.p2p_latency_ms, scale, 0)))



# --------------------------------------------------------------------------- hint


def _canonical_starts(timelines: tuple[tuple[TimedOp, ...], ...]) -> dict[tuple[str, int, int, int], int]:
    """Start tick per (kind, microbatch, stage, chunk), microbatches relabeled by start on each stage and chunk.

    The relabeling is the permutation argument of `_build_model`: it keeps
    every dependency, the stage's occupation and its live activations.
    """
    starts: dict[tuple[str, int, int, int], int] = {}
    for stage, timeline in enumerate(timelines):
        groups: dict[tuple[str, int], list[float]] = {}
        for item in timeline:
            groups.setdefault((item.op.kind, item.op.chunk), []).append(item.start_ms)
        for (kind, chunk), values in groups.items():
            for mb, start in enumerate(sorted(values)):
                starts[kind, mb, stage, chunk] = round(start)
    return starts


def _fits_memory(timelines: tuple[tuple[TimedOp, ...], ...], spec: PipelineSpec, split: bool) -> bool:
    release = WEIGHT_GRAD if split else BACKWARD
    for stage, timeline in enumerate(timelines):
        units = spec.memory_units(stage)
        if units is None:
            continue
        demands, capacity = units
        alive = 0
        for item in timeline:  # ops of a stage never overlap: walking in order is exact
            if item.op.kind == FORWARD:
                alive += demands[item.op.chunk]
                if alive > capacity:
                    return False
            elif item.op.kind == release:
                alive -= demands[item.op.chunk]
    return True


# --------------------------------------------------------------------------- model


@dataclass
class _Model:
    model: cp_model.CpModel
    starts: dict[tuple[str, int, int, int], cp_model.IntVar]
    makespan: cp_model.IntVar
    alive: dict[tuple[int, int, int], cp_model.IntVar]  # (mb, stage, chunk) -> F start to release end


@dataclass(frozen=True)
class _Windows:
    """Earliest start and least remaining time (own duration included) per (kind, microbatch, virtual stage)."""

    earliest: dict[tuple[str, int, int], int]
    remaining: dict[tuple[str, int, int], int]

    @property
    def floor(self) -> int:
        """No makespan in microbatch order (so none at all, see `_build_model`) is shorter."""
        return max(self.earliest[key] + self.remaining[key] for key in self.earliest)


def _windows(ticks: PipelineSpec, split: bool) -> _Windows:
    """Time windows of every op from the dependency chains and the microbatch order, in ticks."""
    p, v, m = ticks.num_stages, ticks.virtual_stages, ticks.num_microbatches
    V = p * v
    L = int(ticks.hop_latency_ms)
    back = INPUT_GRAD if split else BACKWARD

    def duration(kind: str, vs: int) -> int:
        s, c = ticks.physical(vs)
        return int(ticks.chunks[s][c].duration_ms(kind))

    earliest: dict[tuple[str, int, int], int] = {}
    for mb in range(m):
        for vs in range(V):
            earliest[FORWARD, mb, vs] = max(
                earliest[FORWARD, mb, vs - 1] + duration(FORWARD, vs - 1) + L if vs > 0 else 0,
                earliest[FORWARD, mb - 1, vs] + duration(FORWARD, vs) if mb > 0 else 0,
            )
        for vs in reversed(range(V)):
            earliest[back, mb, vs] = max(
                earliest[FORWARD, mb, vs] + duration(FORWARD, vs),
                earliest[back, mb, vs + 1] + duration(back, vs + 1) + L if vs < V - 1 else 0,
                earliest[back, mb - 1, vs] + duration(back, vs) if mb > 0 else 0,
            )
            if split:
                earliest[WEIGHT_GRAD, mb, vs] = max(
                    earliest[INPUT_GRAD, mb, vs] + duration(INPUT_GRAD, vs),
                    earliest[WEIGHT_GRAD, mb - 1, vs] + duration(WEIGHT_GRAD, vs) if mb > 0 else 0,
                )
    remaining: dict[tuple[str, int, int], int] = {}
    for mb in reversed(range(m)):
        for vs in range(V):
            if split:
                remaining[WEIGHT_GRAD, mb, vs] = duration(WEIGHT_GRAD, vs) + (
                    remaining[WEIGHT_GRAD, mb + 1, vs] if mb < m - 1 else 0
                )
            remaining[back, mb, vs] = duration(back, vs) + max(
                remaining[back, mb, vs - 1] + L if vs > 0 else 0,
                remaining[back, mb + 1, vs] if mb < m - 1 else 0,
                remaining[WEIGHT_GRAD, mb, vs] if split else 0,
            )
        for vs in reversed(range(V)):
            remaining[FORWARD, mb, vs] = duration(FORWARD, vs) + max(
                remaining[FORWARD, mb, vs + 1] + L if vs < V - 1 else 0,
                remaining[FORWARD, mb + 1, vs] if mb < m - 1 else 0,
                remaining[back, mb, vs],
            )
    return _Windows(earliest, remaining)


def _build_model(ticks: PipelineSpec, split: bool, windows: _Windows, horizon: int, floor: int) -> _Model:
    """CP-SAT model of the schedule in integer ticks.

    Symmetry breaking by the permutation argument: take any feasible
    timetable and, on each virtual stage and for each kind, give the k-th
    earliest op of that kind microbatch k. Same-kind ops of a virtual stage
    have equal durations, so the set of occupied intervals on every stage
    is unchanged (no-overlap still holds). Every dependency is between two
    families of equal size matched one-to-one (F(vs-1) -> F(vs),
    F(vs) -> B(vs), B(vs+1) -> B(vs), I(vs) -> W(vs)); if some matching
    has start_j >= end_pi(j) + lag for all j, the sorted matching has it
    too (the k-th smallest start is >= the k-th smallest end + lag). The
    activations alive at t on a stage and chunk are #F started minus
    #B (or W) ended by t, the same sets of times before and after. So an
    optimal timetable with same-kind ops in microbatch order exists.
    """
    p, v, m = ticks.num_stages, ticks.virtual_stages, ticks.num_microbatches
    V = p * v
    L = int(ticks.hop_latency_ms)
    back = INPUT_GRAD if split else BACKWARD
    release = WEIGHT_GRAD if split else BACKWARD
    kinds = op_kinds(split)

    earliest, remaining = windows.earliest, windows.remaining

    def duration(kind: str, vs: int) -> int:
        s, c = ticks.physical(vs)
        return int(ticks.chunks[s][c].duration_ms(kind))

    horizon = max(horizon, floor)

    model = cp_model.CpModel()

    # Variables: the makespan, and one fixed-size interval per op within
    # [earliest start, horizon - least remaining time].
    makespan = model.new_int_var(floor, horizon, "makespan")
    alive: dict[tuple[int, int, int], cp_model.IntVar] = {}
    starts: dict[tuple[str, int, int, int], cp_model.IntVar] = {}
    ends: dict[tuple[str, int, int, int], cp_model.LinearExpr] = {}
    intervals: list[list[cp_model.IntervalVar]] = [[] for _ in range(p)]
    for kind in kinds:
        for vs in range(V):
            s, c = ticks.physical(vs)
            size = duration(kind, vs)
            for mb in range(m):
                key = (kind, mb, s, c)
                name = f"{kind}{mb}.{c}@{s}"
                start = model.new_int_var(earliest[kind, mb, vs], horizon - remaining[kind, mb, vs], name)
                starts[key], ends[key] = start, start + size
                intervals[s].append(model.new_fixed_size_interval_var(start, size, name))

    # Constraint: a stage runs one op at a time.
    for stage_intervals in intervals:
        model.add_no_overlap(stage_intervals)

    # Constraint: forwards flow up the virtual stages, p2p latency between stages.
    for mb in range(m):
        for vs in range(1, V):
            model.add(starts[(FORWARD, mb) + ticks.physical(vs)] >= ends[(FORWARD, mb) + ticks.physical(vs - 1)] + L)

    # Constraint: a backward (B or I) follows its own forward and the
    # backward of the next virtual stage (+ latency); W follows its I.
    for mb in range(m):
        for vs in range(V):
            here = ticks.physical(vs)
            model.add(starts[(back, mb) + here] >= ends[(FORWARD, mb) + here])
            if vs < V - 1:
                model.add(starts[(back, mb) + here] >= ends[(back, mb) + ticks.physical(vs + 1)] + L)
            if split:
                model.add(starts[(WEIGHT_GRAD, mb) + here] >= ends[(INPUT_GRAD, mb) + here])

    # Constraint (symmetry breaking, see docstring): same-kind ops of a stage and chunk in microbatch order.
    for kind in kinds:
        for s in range(p):
            for c in range(v):
                for mb in range(m - 1):
                    model.add(starts[kind, mb + 1, s, c] >= ends[kind, mb, s, c])

    # Constraint: activations alive from F start to B (or W) end stay under the stage's cap. With one
    # chunk and same-kind ops in microbatch order, "at most k alive" is exactly "F(mb + k) starts after
    # mb's release ends" (alive at t = #F started - #released by t); that precedence replaces the
    # cumulative, which it makes redundant and which cost over a second of search setup at p=8, m=32.
    for s in range(p):
        units = ticks.memory_units(s)
        if units is None:
            continue
        demands, capacity = units
        if v == 1:
            for mb in range(capacity, m):
                model.add(starts[FORWARD, mb, s, 0] >= ends[release, mb - capacity, s, 0])
            continue
        spans, heights = [], []
        for c in range(v):
            if demands[c] == 0:
                continue
            for mb in range(m):
                start, end = starts[FORWARD, mb, s, c], ends[release, mb, s, c]
                length = alive[mb, s, c] = model.new_int_var(0, horizon, f"alive{mb}.{c}@{s}")
                spans.append(model.new_interval_var(start, length, end, f"alive{mb}.{c}@{s}"))
                heights.append(demands[c])
        model.add_cumulative(spans, heights, capacity)

    # Objective: the makespan, after every stage's last release (all else precedes it by the order).
    for s in range(p):
        for c in range(v):
            model.add(makespan >= ends[release, m - 1, s, c])
    model.minimize(makespan)

    # Search: list scheduling inside the solver, the op that can start first at its earliest time; ties
    # to backwards (they unblock the upstream stages), then forwards, then W's (fillers).
    urgency = {back: 0, FORWARD: 1, WEIGHT_GRAD: 2}
    keys = sorted(starts, key=lambda key: (urgency[key[0]], key[1], -key[2], -key[3]))
    model.add_decision_strategy([starts[key] for key in keys], cp_model.CHOOSE_LOWEST_MIN, cp_model.SELECT_MIN_VALUE)
    return _Model(model, starts, makespan, alive)


# --------------------------------------------------------------------------- solve


def optimize_schedule(
    spec: PipelineSpec,
    *,
    time_limit_s: float,
    split_backward: bool,
    hint: Schedule | None = None,
    seed: int = 0,
    workers: int = 1,
    warm_start: bool = True,
    relative_gap_limit: float = 0.0,
    use_solver: bool = True,
) -> OptimizedSchedule | None:
    """The best order found in `time_limit_s`, never worse than `hint`; None if none is found.

    With `split_backward` every backward is I then W (zero-bubble style),
    otherwise a full B; a hint in the other form is converted
    (`with_backward`). The starting point is the best of the hint and,
    with `warm_start`, a few greedy list schedules (`warm_starts`) that
    fit the memory cap: its simulated times are the solver's hint and its
    makespan the horizon, so the solver starts at least as good. When it
    already meets the lower bound it is optimal and the solver is skipped.
    Otherwise CP-SAT improves it; if that finds nothing better in time, the
    starting point itself is returned (`source` names it). None when
    nothing fits the cap (or nothing was found in time). A hint that is
    not a complete, deadlock-free schedule of `spec` raises ScheduleError.
    `relative_gap_limit` stops as soon as the order is that close to the
    bound (status FEASIBLE): a plan need not pay seconds for the last 0.1%.
    Without `use_solver` the best starting point is returned as it is
    (OPTIMAL only if it meets the bound): tens of milliseconds, not seconds.
    """
    started = time.perf_counter()
    bound = lower_bound_ms(spec, split_backward=split_backward)
    if math.isinf(bound):
        return None  # a stage's cap is below one microbatch's activations
    good_enough = bound * (1 + relative_gap_limit)
    first, first_name = _starting_point(spec, split_backward, hint, warm_start, good_enough)

    scale, exact = _choose_ticks_per_ms(spec, first.makespan_ms if first else sequential_ms(spec))

    def result(schedule: Schedule, makespan: float, objective: float, best_bound: float, status: str,
               source: str, deterministic_time: float = 0.0) -> OptimizedSchedule:
        return OptimizedSchedule(
            Schedule(OPTIMIZED, schedule.orders), makespan, objective / scale, best_bound / scale, bound, status,
            time.perf_counter() - started, scale, exact, source, deterministic_time,
        )

    if first is not None and (not use_solver or bound < first.makespan_ms <= good_enough):
        # Close enough to the bound already (the tick model would only confirm it), or no solver wanted.
        status = "OPTIMAL" if first.makespan_ms <= bound else "FEASIBLE"
        return OptimizedSchedule(
            Schedule(OPTIMIZED, first.schedule.orders), first.makespan_ms, first.makespan_ms, bound, bound, status,
            time.perf_counter() - started, scale, exact, first_name,
        )
    if not use_solver:
        return None
    scaled = _scaled(spec, scale, split_backward, first, hint)
    if scaled.first_ticks is not None and scaled.first_ticks <= scaled.floor:
        return result(first.schedule, first.makespan_ms, scaled.first_ticks, scaled.floor, "OPTIMAL", first_name)
    if scaled.first_ticks is not None and scaled.first_ticks <= scaled.floor * (1 + relative_gap_limit):
        return result(first.schedule, first.makespan_ms, scaled.first_ticks, scaled.floor, "FEASIBLE", first_name)

    built = _hinted_model(scaled, split_backward)
    # The limit less a margin for reading the solution back and simulating it, and less the starting points
    # and the model as priced in work, not as timed: the same spec and limit get the same search on any load.
    ops = spec.num_stages * spec.virtual_stages * spec.num_microbatches * (3 if split_backward else 2)
    setup_s = PRICE_S[Work.SCHEDULE_OP] * ops
    solver, status = _solve(built.model, 0.97 * time_limit_s - 0.02 - setup_s, seed, workers, relative_gap_limit)
    solved_time = solver.deterministic_time
    best_bound = scaled.floor
    if status != cp_model.INFEASIBLE:
        best_bound = max(scaled.floor, math.ceil(solver.best_objective_bound - 1e-6))

    # Report: the solved order, checked by simulation; the starting point if that is better.
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        schedule = _read_back(solver, built, spec.num_stages)
        makespan = simulate(schedule, spec).makespan_ms
        if first is None or makespan <= first.makespan_ms:
            return result(schedule, makespan, round(solver.objective_value), best_bound,
                          solver.status_name(status), "cp-sat", solved_time)
    if first is None:
        return None
    objective = scaled.first_ticks if scaled.first_ticks is not None else round(scaled.guide_run.makespan_ms)
    return result(first.schedule, first.makespan_ms, objective, best_bound, solver.status_name(status), first_name,
                  solved_time)


def _starting_point(spec: PipelineSpec, split_backward: bool, hint: Schedule | None, warm_start: bool,
                    good_enough_ms: float) -> tuple[Start | None, str]:
    """The best of the hint (simulated) and, with `warm_start`, the greedy list schedules that fit the
    memory cap, and its name ("hint" or the list schedule's); (None, "") when nothing fits."""
    starts = []
    hinted_start = None
    if hint is not None:
        hinted = with_backward(hint, split_backward)
        run = simulate(hinted, spec)
        if not run.over_memory(spec):
            hinted_start = Start(hinted, run.makespan_ms, sum(run.peak_in_flight))
            starts.append(hinted_start)
    # A start this close to the bound is returned as it is: looking for more would not pay.
    if warm_start and not (starts and starts[0].makespan_ms <= good_enough_ms):
        starts += warm_starts(spec, split_backward, good_enough_ms)
    first = min(starts, key=lambda start: (start.makespan_ms, start.peak_sum), default=None)
    return first, "" if first is None else "hint" if first is hinted_start else first.schedule.name


@dataclass(frozen=True)
class _Scaled:
    """The problem in integer ticks: the spec, time windows, the makespan's floor and horizon, and the
    starting point simulated in ticks (`first_ticks`: its makespan, if it fits the model's rounded cap)."""

    ticks: PipelineSpec
    windows: _Windows
    floor: int
    horizon: int
    guide_run: SimulationResult | None
    first_ticks: int | None


def _scaled(spec: PipelineSpec, scale: float, split_backward: bool, first: Start | None,
            hint: Schedule | None) -> _Scaled:
    ticks = _tick_spec(spec, scale)
    windows = _windows(ticks, split_backward)
    floor = max(windows.floor, math.ceil(lower_bound_ms(ticks, split_backward=split_backward) - 1e-6))
    guide = first.schedule if first else (with_backward(hint, split_backward) if hint is not None else None)
    guide_run = simulate(guide, ticks) if guide is not None else None
    first_ticks = None
    if first is not None and _fits_memory(guide_run.timelines, ticks, split_backward):
        first_ticks = round(guide_run.makespan_ms)
    horizon = first_ticks if first_ticks is not None else math.ceil(sequential_ms(ticks))
    return _Scaled(ticks, windows, floor, horizon, guide_run, first_ticks)


def _hinted_model(scaled: _Scaled, split_backward: bool) -> _Model:
    """Variables, constraints, objective (`_build_model`), with the starting point's times as the hint."""
    built = _build_model(scaled.ticks, split_backward, scaled.windows, scaled.horizon, scaled.floor)
    if scaled.guide_run is None:
        return built
    release = WEIGHT_GRAD if split_backward else BACKWARD
    hinted_starts = _canonical_starts(scaled.guide_run.timelines)
    for key, start in hinted_starts.items():
        built.model.add_hint(built.starts[key], start)
    for (mb, s, c), length in built.alive.items():
        end = hinted_starts[release, mb, s, c] + int(scaled.ticks.chunks[s][c].duration_ms(release))
        built.model.add_hint(length, end - hinted_starts[FORWARD, mb, s, c])
    built.model.add_hint(built.makespan, round(scaled.guide_run.makespan_ms))
    return built


def _solve(model: cp_model.CpModel, time_limit_s: float, seed: int, workers: int,
           relative_gap_limit: float) -> tuple[cp_model.CpSolver, int]:
    solver = new_solver(time_limit_s, seed, workers)
    if workers == 1:
        # One worker follows the model's decision strategy (measured: reaches the optimum of p=8, m=32,
        # slow 1.5, memory cap 8 from the ZB-H1 hint in 1.8 s where the default search stays at 152).
        # More workers run CP-SAT's default portfolio (worse here on the shared 2-core machine: 152 in 2 s).
        solver.parameters.search_branching = cp_model.FIXED_SEARCH
    # No LP relaxation: the floor already carries the bounds it would find, and building it for p=16, m=128
    # took ~2 s that the time limit does not interrupt (the solve ran 3.3 s on a 1.6 s limit).
    solver.parameters.linearization_level = 0
    solver.parameters.relative_gap_limit = relative_gap_limit
    return solver, solver.solve(model)


def _read_back(solver: cp_model.CpSolver, built: _Model, num_stages: int) -> Schedule:
    """Each stage's ops in the order of their solved starts."""
    timed: list[list[tuple[int, Op]]] = [[] for _ in range(num_stages)]
    for (kind, mb, stage, c), var in built.starts.items():
        timed[stage].append((solver.value(var), Op(kind, mb, c)))
    return Schedule(OPTIMIZED, tuple(tuple(op for _, op in sorted(ops)) for ops in timed))


__all__ = ["OPTIMIZED", "OptimizedSchedule", "ScheduleError", "optimize_schedule"]
