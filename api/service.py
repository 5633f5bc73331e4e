"""Request -> plan (or detection), shared by the HTTP routes, their solver workers and the command line."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from api.convert import resolve_model, to_problem, to_wire
from api.schemas import DetectRequest, DetectResponse, EstimateRequest, FailSlowDevice, Plan, PlanRequest
from planner.detection import Microbatch, TelemetryItem, detect, layout_from_plan
from planner.detection.telemetry import TelemetryError
from planner.errors import PlanningError
from planner.estimate import FixedLayout, estimate_layout
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
    deadline the server set holds in a worker process, and time spent queued comes off the budget)."""
    return to_wire(plan(budgeted(to_problem(request), max_time_limit_s, solve_by_monotonic_s)), new_plan_id())


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
    """A plan as a solver worker hands it back: its JSON, ready to store and send. Unpickling a pydantic
    Plan would cost the server's event loop ~70 ms for a 4,096-GPU plan; this costs ~2 ms."""

    plan: dict[str, Any]

    @property
    def plan_id(self) -> str:
        return self.plan["plan_id"]

    @property
    def solver_status(self) -> str:
        return self.plan["solver"]["status"]


def plan_answer(request: PlanRequest, max_time_limit_s: float | None, solve_by_monotonic_s: float | None) -> PlanAnswer:
    """plan_for, for a solver worker."""
    return PlanAnswer(plan_for(request, max_time_limit_s, solve_by_monotonic_s).model_dump(mode="json"))


def estimate_answer(request: EstimateRequest) -> PlanAnswer:
    """estimate_for, for a solver worker."""
    return PlanAnswer(estimate_for(request).model_dump(mode="json"))


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


# /v1/detect ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanNeeded:
    """`detect_json`'s answer when it was not given the stored plan the request names: fetch that one."""

    plan_id: str


class BodyValidationError(Exception):
    """A request body failed validation; `errors` are in the form FastAPI answers 422 with."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors)
        self.errors = errors


def detect_json(body: bytes, stored_plan: dict[str, Any] | None) -> DetectResponse | PlanNeeded:
    """Parse, validate and run a /v1/detect body against `stored_plan` (the stored Plan JSON).

    Runs in a solver worker: 4,096 devices x 8 iterations of telemetry is ~24 MB of JSON, seconds of
    parsing that must not hold the server's event loop.
    """
    try:
        request = DetectRequest.model_validate_json(body)
    except ValidationError as error:
        raise BodyValidationError(body_errors(error)) from None
    if stored_plan is None or stored_plan.get("plan_id") != request.plan_id:
        return PlanNeeded(request.plan_id)
    return detect_for(Plan.model_validate(stored_plan), request)


def detect_for(plan: Plan, request: DetectRequest) -> DetectResponse:
    if plan.architecture is not None:
        model = resolve_model(plan.architecture)
    elif plan.model:
        model = resolve_model(plan.model)
    else:
        raise PlanningError(f"plan {plan.plan_id} records no model architecture to normalize compute times with")
    layout = layout_from_plan(plan, model)
    items = [
        TelemetryItem(
            device=item.device,
            iteration=item.iteration,
            microbatches=tuple(Microbatch(tuple(mb.seq_lengths), mb.compute_ms) for mb in item.microbatches),
            last_heartbeat_s_ago=item.last_heartbeat_s_ago,
        )
        for item in request.telemetry
    ]
    try:
        result = detect(items, layout)
    except TelemetryError as error:
        raise PlanningError(f"plan {plan.plan_id}: {error}") from None
    return DetectResponse(
        fail_slow=[FailSlowDevice(device=f.device, speed=f.speed, confidence=f.confidence) for f in result.fail_slow],
        fail_stop=list(result.fail_stop),
    )


_ECHOED_INPUT_CHARS = 200


def body_errors(error: ValidationError) -> list[dict[str, Any]]:
    """Validation errors as FastAPI reports a body's (`loc` from "body"), plain JSON, and without
    echoing large inputs: a 24 MB body must not come back in its own 422."""
    errors = []
    for item in error.errors(include_url=False):
        entry: dict[str, Any] = {"type": item["type"], "loc": ["body", *item["loc"]], "msg": item["msg"]}
        value = item.get("input")
        if "input" in item and (
            value is None
            or isinstance(value, bool | int | float)
            or (isinstance(value, str) and len(value) <= _ECHOED_INPUT_CHARS)
        ):
            entry["input"] = value
        if item.get("ctx"):
            entry["ctx"] = {key: v if isinstance(v, bool | int | float | str) else str(v) for key, v in item["ctx"].items()}
        errors.append(entry)
    return errors
