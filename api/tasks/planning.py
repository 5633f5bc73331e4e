"""Request -> plan: POST /v1/plan and /v1/estimate in a solver worker, and `resiplan plan` / `estimate`."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

from planner.budget import Budget
from planner.deadline import (
    late_start_note,
    least_time_limit_s,
    raised_limit_note,
    reading_s,
    transfer_s,
    wire_reserve_s,
)
from planner.estimate import estimate_layout
from planner.estimate_replicas import ReplicaLayout, estimate_replicas
from planner.plan import plan
from planner.problem import PlanningProblem
from planner.result import PlanResult
from wire.calibration import AppliedCalibration, with_calibration_scope
from wire.convert import to_fixed_layout, to_problem, to_wire
from wire.schemas import EstimateRequest, Plan, PlanRequest


def new_plan_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class AnswerDeadline:
    """The deadline one answer keeps: `budget` (the planner's, less the wire reserve), the limit it keeps
    counted from the request's arrival, and the notes saying why it differs from the one asked for."""

    budget: Budget
    limit_s: float
    notes: tuple[str, ...]


def answer_deadline(problem: PlanningProblem, max_time_limit_s: float | None = None,
                    read_by: Budget | None = None) -> AnswerDeadline:
    """The deadline of the answer to `problem`: `options.time_limit_s`, capped by `max_time_limit_s`,
    counted from the request's arrival, before it was read (the server hands over `read_by`: the capped
    limit from the moment it had read the request; the monotonic clock is system-wide on Linux, so that
    deadline holds in a worker process and time spent queued comes off it). It covers the whole answer:
    the planner returns early enough for the wire form, its JSON and the store (`planner.deadline`). A
    limit below the least this request's answer takes (`least_time_limit_s`) is raised to it, with a note,
    as it is when the request waited so long for a solver process that less than the least is left."""
    started_s = time.monotonic()
    limit_s = min(problem.time_limit_s, max_time_limit_s) if max_time_limit_s is not None else problem.time_limit_s
    read_s = reading_s(problem)
    arrived_s = (read_by.deadline_s if read_by is not None else started_s + limit_s) - limit_s - read_s
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
    # The search's work is what the limit leaves on time, fixed in advance, so that the same request gets the
    # same work however long it waited or however loaded the machine is; time lost counts on the wall-clock
    # safety net (`Budget.as_work`).
    planned_s = max(limit_s, least_s) - read_s - transfer_s(problem)
    budget = Budget(deadline_s, work_s=planned_s).less(wire_reserve_s(problem))
    return AnswerDeadline(budget, round(deadline_s - arrived_s, 3), notes)


def with_deadline_report(result: PlanResult, deadline: AnswerDeadline) -> PlanResult:
    """`result` saying which limit it kept and why (`solver.time_limit_s`, `solver.notes`)."""
    solver = replace(result.solver, time_limit_s=deadline.limit_s, notes=deadline.notes + result.solver.notes)
    return replace(result, solver=solver)


def plan_for(request: PlanRequest, max_time_limit_s: float | None = None, read_by: Budget | None = None,
             calibration: AppliedCalibration | None = None) -> Plan:
    """The plan for `request`, by the deadline `answer_deadline` sets; `calibration`: the stored one
    `options.calibration_id` names."""
    problem = to_problem(request, calibration)
    deadline = answer_deadline(problem, max_time_limit_s, read_by)
    return with_calibration_scope(to_wire(with_deadline_report(plan(problem, deadline.budget), deadline), new_plan_id()),
                                  problem, calibration)


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


def plan_answer(request: PlanRequest, max_time_limit_s: float | None, read_by: Budget | None,
                calibration: AppliedCalibration | None = None) -> PlanAnswer:
    """plan_for, for a solver worker."""
    return PlanAnswer.of(plan_for(request, max_time_limit_s, read_by, calibration), request)


def estimate_answer(request: EstimateRequest, calibration: AppliedCalibration | None = None) -> PlanAnswer:
    """estimate_for, for a solver worker."""
    return PlanAnswer.of(estimate_for(request, calibration), request)


def estimate_for(request: EstimateRequest, calibration: AppliedCalibration | None = None) -> Plan:
    problem, layout = to_problem(request, calibration), to_fixed_layout(request.layout)
    found = estimate_replicas(problem, layout) if isinstance(layout, ReplicaLayout) else estimate_layout(problem, layout)
    return with_calibration_scope(to_wire(found, new_plan_id()), problem, calibration)
