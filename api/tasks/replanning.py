"""Stored plan + failure state now -> new plan with its migration (the replan route and CLI)."""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError

from api.tasks.planning import (
    AnswerDeadline,
    PlanAnswer,
    answer_deadline,
    new_plan_id,
    with_deadline_report,
)
from cost_models.device import device_id
from planner.budget import Budget
from planner.problem import PlanningProblem
from planner.replan.choice import ReplanResult, replan, running_plan
from wire.calibration import AppliedCalibration, with_calibration_scope
from wire.convert import to_problem, to_wire
from wire.errors import RequestBodyInvalid
from wire.migration import Migration, ReplanCandidate, transfer_to_wire
from wire.schemas import Plan, PlanRequest, ReplanRequest, SlowDevice


def replan_request(parent_request: dict[str, Any], body: ReplanRequest) -> PlanRequest:
    """The parent's request with the failure state now and the options the caller changed."""
    # A stored estimate carries the layout it priced; a replan searches afresh.
    merged = {k: v for k, v in parent_request.items() if k != "layout"}
    merged["failures"] = body.failures.model_dump(mode="json")
    if body.options is not None:
        merged["options"] = {**merged.get("options", {}), **body.options.model_dump(mode="json", exclude_unset=True)}
    try:
        return PlanRequest.model_validate(merged)
    except ValidationError as error:
        problems = RequestBodyInvalid.from_validation(error)
        raise RequestBodyInvalid(f"the parent plan's request with these failures and options is invalid: "
                                 f"{problems.detail}", problems.errors) from None


# Said in a kept plan's solver.notes: its other solver fields describe this answer.
KEPT_NOTE = ("the running plan kept (migration.chosen keep): its layout and schedules are its parent's, and so are "
             "status, gap and bound_ms, from the parent's search under the parent's failure state; objective_ms is "
             "the bound on its iteration time now")


def _kept(parent: Plan, problem: PlanningProblem, plan_id: str, iteration_s: float, deadline: AnswerDeadline,
          wall_time_s: float) -> Plan:
    """The running plan under the failure state now: same layout and stage times, devices' roles
    updated, predicted figures scaled to the bound on its iteration time now; its solver report says this
    answer's limit, wall time and objective (`KEPT_NOTE`)."""
    cluster = problem.cluster
    scale = parent.predicted.iteration_time_s / iteration_s
    predicted = parent.predicted.model_copy(update={
        "iteration_time_s": iteration_s,
        "tokens_per_s": parent.predicted.tokens_per_s * scale,
        "mfu": parent.predicted.mfu * scale,
    })
    used = {d for replica in parent.replicas for stage in replica.stages for d in stage.devices}
    every = [(n, g) for n in range(cluster.num_nodes) for g in range(cluster.gpus_per_node)]
    solver = parent.solver.model_copy(update={
        "time_limit_s": deadline.limit_s, "wall_time_s": round(wall_time_s, 3),
        "objective_ms": round(1e3 * iteration_s, 3),
        "notes": [*deadline.notes, KEPT_NOTE, *(f"the parent's: {note}" for note in parent.solver.notes)]})
    return parent.model_copy(update={
        "plan_id": plan_id,
        "predicted": predicted,
        "solver": solver,
        "excluded_devices": [device_id(n, g) for n, g in every if (n, g) in cluster.failed],
        "unused_devices": [device_id(n, g) for n, g in every
                           if (n, g) not in cluster.failed and device_id(n, g) not in used],
        "slow_devices": [SlowDevice(device=device_id(*d), speed=speed) for d, speed in cluster.slow],
    }, deep=True)


def _migration(found: ReplanResult, num_layers: int) -> Migration:
    cost = found.migration
    return Migration(
        bytes_moved=cost.bytes_moved,
        devices_changed=list(cost.devices_changed),
        estimated_s=round(cost.estimated_s, 3),
        bytes_from_checkpoint=cost.bytes_from_checkpoint,
        transfers=[transfer_to_wire(transfer, num_layers) for transfer in cost.transfers],
        amortize_iterations=found.amortize_iterations,
        chosen=found.chosen.name,
        candidates=[
            ReplanCandidate(name=c.name, iteration_time_s=c.iteration_s, bytes_moved=c.migration.bytes_moved,
                            migration_s=round(c.migration.estimated_s, 3), objective_ms=round(c.objective_ms, 3))
            for c in found.candidates
        ],
    )


def replan_for(request: PlanRequest, parent_plan: dict[str, Any] | Plan, plan_id: str,
               max_time_limit_s: float | None = None, read_by: Budget | None = None,
               calibration: AppliedCalibration | None = None) -> Plan:
    """The new plan for `request` (see `replan_request`), moving from the stored `parent_plan`."""
    started_s = time.monotonic()
    problem = to_problem(request, calibration)
    deadline = answer_deadline(problem, max_time_limit_s, read_by)
    parent = parent_plan if isinstance(parent_plan, Plan) else Plan.model_validate(parent_plan)
    running = running_plan(parent, {s.device: s.speed for s in parent.slow_devices})
    found = replan(problem, running, request.options.amortize_iterations, deadline.budget)
    if found.result is None:
        plan = _kept(parent, problem, plan_id, found.chosen.iteration_s, deadline, time.monotonic() - started_s)
    else:
        plan = to_wire(with_deadline_report(found.result, deadline), plan_id)
    plan = with_calibration_scope(plan, problem, calibration)
    return plan.model_copy(update={"parent_plan_id": parent.plan_id, "migration": _migration(found, problem.workload.model.num_layers)})


def replan_answer(parent_request: dict[str, Any], body: ReplanRequest, parent_plan_json: str,
                  max_time_limit_s: float | None, read_by: Budget | None,
                  calibration: AppliedCalibration | None = None) -> PlanAnswer:
    """replan_request + replan_for, for a solver worker: the merged request is validated and the stored
    parent plan (the JSON text the store holds) parsed there, not in the server's event loop."""
    request = replan_request(parent_request, body)
    parent_plan = Plan.model_validate_json(parent_plan_json)
    return PlanAnswer.of(replan_for(request, parent_plan, new_plan_id(), max_time_limit_s, read_by, calibration),
                         request)
