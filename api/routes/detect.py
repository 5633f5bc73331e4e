"""/v1/detect: fail-slow and fail-stop devices of a stored plan from a window of telemetry."""

from __future__ import annotations

import re

from fastapi import APIRouter, FastAPI, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from api.core.body import body_openapi, document_bodies
from api.deps import PoolDep, SettingsDep, StoreDep
from api.routes.plans import SOLVE_RESPONSES, V1_RESPONSES
from api.tasks.detection import PlanNeeded, detect_json
from wire.detection import DetectRequest, DetectResponse
from wire.schemas import ErrorDetail

DETECT_PATH = "/v1/detect"

router = APIRouter(prefix="/v1", tags=["detect"], responses=V1_RESPONSES)

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
# The top-level plan_id, read ahead of parsing so the worker gets the stored plan with the body. Inside
# a valid body the bytes `"plan_id":` occur only as that key (a JSON string cannot hold a bare quote, and
# nested objects forbid unknown keys); the worker checks it against the parsed request anyway.
_PLAN_ID = re.compile(rb'"plan_id"\s*:\s*"([^"\\]{1,64})"')


@router.post(
    "/detect",
    response_model=DetectResponse,
    responses={
        404: {"model": ErrorDetail, "description": "No stored plan with this id."},
        422: {"model": ErrorDetail, "description": "Malformed telemetry, or a device in none of the plan's stages."},
        **SOLVE_RESPONSES,
    },
    openapi_extra=body_openapi(DetectRequest, {"one item": {"value": _EXAMPLE}}),
)
async def detect_failures(request: Request, settings: SettingsDep, store: StoreDep, pool: PoolDep) -> DetectResponse:
    """Fail-slow devices (with estimated speed) and fail-stop devices (stale heartbeat) of a stored plan.

    Send the last 8 iterations of every device; the detector keeps no state between calls.
    Compute times are normalized by each microbatch's work (tokens, and each packed sequence's
    length squared for attention) and compared with the devices doing the same work.
    The body (a `DetectRequest`) is parsed and validated in a solver worker, not in the event loop,
    one telemetry item at a time: a large cluster's telemetry is tens of MB.
    """
    body = await request.body()
    peeked = _peeked_plan_id(body)
    # The plan's JSON text goes to the worker as stored: the event loop never parses a plan.
    stored = await run_in_threadpool(store.get_json, peeked) if peeked else None
    answer = await pool.run(detect_json, body, stored, deadline_s=settings.max_time_limit_s)
    if isinstance(answer, PlanNeeded):
        stored = await run_in_threadpool(store.get_json, answer.plan_id)
        if stored is None:
            raise HTTPException(status_code=404, detail=f"no plan with id {answer.plan_id!r}")
        answer = await pool.run(detect_json, body, stored, deadline_s=settings.max_time_limit_s)
    return answer


def _peeked_plan_id(body: bytes) -> str | None:
    """The plan id the body seems to name, or None (the worker then parses it and says which it is)."""
    peeked = _PLAN_ID.search(body)
    if peeked is None:
        return None
    try:
        return peeked.group(1).decode("utf-8")
    except UnicodeDecodeError:  # not UTF-8: the worker answers 422 saying so
        return None


def document_request_body(app: FastAPI) -> None:
    """Put DetectRequest and the models it uses into the OpenAPI components the route's body refers to
    (FastAPI adds only models it parses itself)."""
    document_bodies(app, (DetectRequest,))
