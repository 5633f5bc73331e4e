"""The one way the planner's CP-SAT models get a solver: a time limit, a fixed seed, a worker count.

Every model is small and solved many times, so the deterministic single-worker search is the default;
`presolve=False` is for models whose few variables carry large tick-valued coefficients, where presolve
costs more than it saves (measured per model, see the callers)."""

from __future__ import annotations

from ortools.sat.python import cp_model

# CP-SAT rejects a zero or negative limit; this is the least a probe is given.
MIN_SOLVE_S = 0.01
# Wall seconds a solve may take per unit of deterministic time before the safety net stops it: CP-SAT's
# unit runs at 0.2-1 s on this machine idle, so 4 leaves room for a machine loaded 4-fold.
WALL_SAFETY = 4.0


def limit_solver(solver: cp_model.CpSolver, time_limit_s: float, wall_limit_s: float | None = None) -> None:
    """Limit `solver`'s next solve: `time_limit_s` of deterministic time, a wall-time safety net."""
    solver.parameters.max_deterministic_time = max(MIN_SOLVE_S, time_limit_s)
    wall_s = wall_limit_s if wall_limit_s is not None else WALL_SAFETY * time_limit_s
    solver.parameters.max_time_in_seconds = max(MIN_SOLVE_S, wall_s)


def stopped_by_wall(solver: cp_model.CpSolver) -> bool:
    """Whether the last solve ended at its wall-time safety net (not its deterministic limit, nor done)."""
    return solver.wall_time >= 0.99 * solver.parameters.max_time_in_seconds and (
        solver.deterministic_time < 0.99 * solver.parameters.max_deterministic_time)


def new_solver(time_limit_s: float | None, seed: int, workers: int = 1, *, presolve: bool = True,
               wall_limit_s: float | None = None) -> cp_model.CpSolver:
    """A CpSolver limited to `time_limit_s` units of CP-SAT's deterministic time (about seconds on an
    idle machine; the same work whatever the load, so the same answer), with `wall_limit_s` seconds of
    wall time as a safety net (default WALL_SAFETY x the deterministic limit). None: no limit; set it
    per solve instead (`limit_solver`)."""
    solver = cp_model.CpSolver()
    if time_limit_s is not None:
        limit_solver(solver, time_limit_s, wall_limit_s)
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    if not presolve:
        solver.parameters.cp_model_presolve = False
    return solver
