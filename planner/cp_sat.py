"""The one way the planner's CP-SAT models get a solver: a time limit, a fixed seed, a worker count.

Every model is small and solved many times, so the deterministic single-worker search is the default;
`presolve=False` is for models whose few variables carry large tick-valued coefficients, where presolve
costs more than it saves (measured per model, see the callers)."""

from __future__ import annotations

from ortools.sat.python import cp_model

# CP-SAT rejects a zero or negative limit; this is the least a probe is given.
MIN_SOLVE_S = 0.01


def new_solver(time_limit_s: float | None, seed: int, workers: int = 1, *, presolve: bool = True) -> cp_model.CpSolver:
    """A CpSolver limited to `time_limit_s` seconds (None: no limit; set it per solve instead)."""
    solver = cp_model.CpSolver()
    if time_limit_s is not None:
        solver.parameters.max_time_in_seconds = max(MIN_SOLVE_S, time_limit_s)
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    if not presolve:
        solver.parameters.cp_model_presolve = False
    return solver
