"""The one way the planner's CP-SAT models get a solver: a time limit, a fixed seed, a worker count.

Every model is small and solved many times, so the deterministic single-worker search is the default;
`presolve=False` is for models whose few variables carry large tick-valued coefficients, where presolve
costs more than it saves (measured per model, see the callers)."""

from __future__ import annotations

from ortools.sat.python import cp_model

from planner.budget import WALL_SAFETY
from planner.work import DETERMINISTIC_UNITS_PER_S

# CP-SAT rejects a zero or negative limit; this is the least a probe is given.
MIN_SOLVE_S = 0.01


def limit_solver(solver: cp_model.CpSolver, time_limit_s: float, wall_limit_s: float | None = None) -> None:
    """Limit `solver`'s next solve to about `time_limit_s` seconds of work, counted in CP-SAT's
    deterministic time (the same work, so the same answer, on a loaded machine), with `wall_limit_s`
    of wall time as the safety net (default `WALL_SAFETY` x the limit)."""
    solver.parameters.max_deterministic_time = max(MIN_SOLVE_S, time_limit_s) * DETERMINISTIC_UNITS_PER_S
    wall_s = wall_limit_s if wall_limit_s is not None else WALL_SAFETY * time_limit_s
    solver.parameters.max_time_in_seconds = max(MIN_SOLVE_S, wall_s)


def new_solver(time_limit_s: float | None, seed: int, workers: int = 1, *, presolve: bool = True,
               wall_limit_s: float | None = None) -> cp_model.CpSolver:
    """A CpSolver limited to about `time_limit_s` seconds of work (`limit_solver`; None: no limit, set
    it per solve instead), with a fixed seed and `workers` workers."""
    solver = cp_model.CpSolver()
    if time_limit_s is not None:
        limit_solver(solver, time_limit_s, wall_limit_s)
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    if not presolve:
        solver.parameters.cp_model_presolve = False
    return solver
