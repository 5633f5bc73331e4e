"""Request -> plan: POST /v1/plan and /v1/estimate in a solver worker, and `resiplan plan` / `estimate`."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

from wire.convert import to_problem, to_wire
from wire.schemas import EstimateRequest, Plan, PlanRequest
from planner.estimate import FixedLayout, estimate_layout
from planner.budget import Budget
from planner.deadline import (
    late_start_note,
    least_time_limit_s,
    raised_limit_note,
    reading_s,
    transfer_s,
    wire_reserve_s,
)
from planner.plan import plan
from planner.problem import PlanningProblem

# The least solver budget a request gets even when it waited in the queue past its deadline.
MIN_SOLVE_S = 0.05


def new_plan_id() -> str:
    return uuid.uuid4().hex


def plan_for(
    request: PlanRequest, max_time_limit_s: float | None = None, solve_by_monotonic_s: float | None = None
) -> Plan:
    """The plan for `request`, its solver budget capped by `max_time_limit_s` and by the time left until
    `solve_by_monotonic_s` (a `time.monotonic()` instant; the clock is system-wide on Linux, so a
    deadline the server set holds in a worker process, and time spent queued comes off the budget).

    The deadline counts from the request's arrival, before it was read (the server sets
    `solve_by_monotonic_s` to the moment it had read it plus the capped limit), and covers the whole
    answer: the planner returns early enough for the wire form, its JSON and the store
    (`planner.deadline`). A limit below the least this request's answer takes (`least_time_limit_s`)
    is raised to it, and the answer says so in `solver.notes`, as it does when the request waited so
    long for a solver process that less than the least is left.
    """
    started_s = time.monotonic()
    problem = to_problem(request)
    limit_s = min(problem.time_limit_s, max_time_limit_s) if max_time_limit_s is not None else problem.time_limit_s
    read_s = reading_s(problem)
    arrived_s = (solve_by_monotonic_s if solve_by_monotonic_s is not None else started_s + limit_s) - limit_s - read_s
    least_s = least_time_limit_s(problem)
    notes: tuple[str, ...] = ()
    if limit_s < least_s:
        notes += (raised_limit_note(problem, limit_s, least_s),)
    deadline_s = arrived_s + max(limit_s, least_s)
    # What the planner needs from now on at the least: it was read and handed over already.
    least_from_now_s = least_s - read_s - transfer_s(problem)
    if deadline_s - started_s < least_from_now_s:
        notes += (late_start_note(deadline_s - started_s, least_from_now_s),)
        deadline_s = started_s + least_from_now_s
    applied = replace(problem, time_limit_s=deadline_s - started_s)
    result = plan(applied, Budget(deadline_s).less(wire_reserve_s(problem)))
    solver = replace(result.solver, time_limit_s=round(deadline_s - arrived_s, 3), notes=notes + result.solver.notes)
    return to_wire(replace(result, solver=solver), new_plan_id())


def budgeted(
    problem: PlanningProblem, max_time_limit_s: float | None, solve_by_monotonic_s: float | None
) -> PlanningProblem:
    """`problem` with its solver budget capped by the server's maximum and the time left until the deadline."""
    limit_s = problem.time_limit_s
    if max_time_limit_s is not None:
        limit_s = min(limit_s, max_time_limit_s)
    if solve_by_monotonic_s is not None:
        limit_s = min(limit_s, max(MIN_SOLVE_S, solve_by_monotonic_s - time.monotonic()))
    return replace(problem, time_limit_s=limit_s) if limit_s < problem.time_limit_s else problem


@dataclass(frozen=True)
class PlanAnswer:
    """A plan as a solver worker hands it back: its JSON text and its request's, serialized in the worker,
    ready to store and send as they are. The server's event loop never parses or dumps a plan (a
    65,536-GPU plan is tens of MB: a fraction of a second of a loop that also answers health checks)."""

    plan_id: str
    solver_status: str
    plan_json: str
    request_json: str

    @classmethod
    def of(cls, plan: Plan, request: PlanRequest) -> PlanAnswer:
        # `stored` is left out: the route adds it only when the store could not keep the plan.
        return cls(plan.plan_id, plan.solver.status, plan.model_dump_json(exclude={"stored"}),
                   request.model_dump_json())


def plan_answer(request: PlanRequest, max_time_limit_s: float | None, solve_by_monotonic_s: float | None) -> PlanAnswer:
    """plan_for, for a solver worker."""
    return PlanAnswer.of(plan_for(request, max_time_limit_s, solve_by_monotonic_s), request)


def estimate_answer(request: EstimateRequest) -> PlanAnswer:
    """estimate_for, for a solver worker."""
    return PlanAnswer.of(estimate_for(request), request)


def estimate_for(request: EstimateRequest) -> Plan:
    layout = request.layout
    fixed = FixedLayout(
        tp=layout.tp,
        pp=layout.pp,
        micro_batch_size=layout.micro_batch_size,
        virtual_stages=layout.virtual_stages,
        schedule=layout.schedule,
        recompute=layout.recompute,
        layers_per_stage=tuple(layout.layers_per_stage) if layout.layers_per_stage is not None else None,
        dp=layout.dp,
    )
    return to_wire(estimate_layout(to_problem(request), fixed), new_plan_id())
