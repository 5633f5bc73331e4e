"""/v1/detect: fail-slow and fail-stop devices of a stored plan from a window of telemetry."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body
from starlette.concurrency import run_in_threadpool

from api.convert import resolve_model
from api.deps import StoreDep
from api.routes.plans import stored_plan
from api.schemas import DetectRequest, DetectResponse, ErrorDetail, FailSlowDevice, Plan
from planner.detection import Microbatch, TelemetryItem, detect, layout_from_plan
from planner.detection.telemetry import TelemetryError
from planner.errors import PlanningError

router = APIRouter(prefix="/v1", tags=["detect"])

_EXAMPLE = {
    "plan_id": "6f1c…",
    "telemetry": [
        {
            "device": "0:0",
            "iteration": 12,
            "microbatches": [{"seq_lengths": [1024, 3072], "compute_ms": 40.2}],
            "last_heartbeat_s_ago": 0.4,
        }
    ],
}


def _detect(plan: Plan, request: DetectRequest) -> DetectResponse:
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


@router.post(
    "/detect",
    response_model=DetectResponse,
    responses={
        404: {"model": ErrorDetail, "description": "No stored plan with this id."},
        422: {"model": ErrorDetail, "description": "Malformed telemetry, or a device in none of the plan's stages."},
    },
)
async def detect_failures(
    request: Annotated[DetectRequest, Body(openapi_examples={"one item": {"value": _EXAMPLE}})],
    store: StoreDep,
) -> DetectResponse:
    """Fail-slow devices (with estimated speed) and fail-stop devices (stale heartbeat) of a stored plan.

    Send the last 8 iterations of every device; the detector keeps no state between calls.
    Compute times are normalized by each microbatch's work (tokens, and each packed sequence's
    length squared for attention) and compared with the devices doing the same work.
    """
    plan = await stored_plan(request.plan_id, store)
    return await run_in_threadpool(_detect, plan, request)
