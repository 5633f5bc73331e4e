"""/v1/plan (and its unversioned alias POST /plan), /v1/estimate, /v1/compare, /v1/plans/{id}, its exports and view
links.

The event loop only moves bytes: bodies are validated in a thread (api.core.body), plans are solved,
serialized and rendered in the solver pool (api.core.execution), and a stored plan is served as the JSON
text the store holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from adapters.registry import ExportError, export_format, format_names
from api.core.auth import ViewLinks
from api.core.body import body_openapi, json_body, parse_body
from api.core.settings import MAX_VIEW_LINK_TTL_S
from api.core.store import PlanStore, StoreUnavailable
from api.deps import PoolDep, SettingsDep, StoreDep
from api.examples import estimate_examples, scenario_examples
from api.routes.calibration_lookup import applied_calibration
from api.tasks.comparing import compare_answer
from api.tasks.planning import PlanAnswer, estimate_answer, plan_answer
from api.tasks.rendering import render_export
from planner.budget import Budget
from wire.comparison import CompareRequest, CompareResponse
from wire.schemas import ErrorDetail, EstimateRequest, Options, Plan, PlanRequest

log = logging.getLogger("resiplan.routes")

JSON = "application/json"
# Statuses any protected route may answer (401 only when the server has an API token); 422 in the one error
# shape (FastAPI would document its own list-of-errors model).
V1_RESPONSES = {
    401: {"model": ErrorDetail, "description": "Missing or wrong `Authorization: Bearer <token>`."},
    422: {"model": ErrorDetail, "description": "Malformed request; `detail` says why, `errors` which fields."},
}
# And those of a route that solves or renders in the worker pool.
SOLVE_RESPONSES = {
    413: {"model": ErrorDetail, "description": "Request body over this route's size limit."},
    503: {"model": ErrorDetail, "description": "All solver workers busy and the queue full, the solver process "
          "failed, or the plan store is unavailable; retry after `Retry-After` seconds."},
    504: {"model": ErrorDetail, "description": "No answer within the deadline plus the grace period; the solve was stopped."},
}
# Seconds between attempts to store a solved plan while the store is down; then it is answered unstored.
STORE_RETRY_DELAYS_S = (0.2, 0.5)
STORED_HEADER = "X-Resiplan-Stored"

router = APIRouter(prefix="/v1", tags=["plans"], responses=V1_RESPONSES)
# POST /plan: the unversioned route the design brief names; the same handler, schema and auth.
alias_router = APIRouter(tags=["plans"], responses=V1_RESPONSES)

_ERRORS = {
    422: {"model": ErrorDetail, "description": "Malformed or unsatisfiable request; `detail` says why."},
    **SOLVE_RESPONSES,
}
_READ_ERRORS = {
    404: {"model": ErrorDetail},
    503: {"model": ErrorDetail, "description": "The plan store is unavailable; retry after `Retry-After` seconds."},
}
_ReplicaQuery = Annotated[int | None, Query(ge=0, le=2**31, description="Replica id; default the slowest replica.")]


async def answer_with_plan(store: PlanStore, answer: PlanAnswer) -> Response:
    """Store a solved plan, then send it. If the store stays down through a few retries, the plan is sent
    anyway with `"stored": false` (and the header `X-Resiplan-Stored: false`): solving it again is the
    expensive part, and the caller can act on it now; only reading it back by id is lost."""
    for delay_s in (0.0, *STORE_RETRY_DELAYS_S):
        await asyncio.sleep(delay_s)
        try:
            await run_in_threadpool(store.save_json, answer.plan_id, answer.request_json, answer.plan_json)
            return Response(answer.plan_json, media_type=JSON, headers={STORED_HEADER: "true"})
        except StoreUnavailable as error:
            failure = error
    log.error("plan %s answered without being stored: %s", answer.plan_id, failure)
    # The worker left `stored` out of the plan's JSON object; it goes first here.
    return Response('{"stored":false,' + answer.plan_json[1:], media_type=JSON, headers={STORED_HEADER: "false"})


@router.post("/plan", response_model=Plan, responses=_ERRORS,
             openapi_extra=body_openapi(PlanRequest, scenario_examples()))
async def create_plan(
    request: Annotated[PlanRequest, json_body(PlanRequest)],
    settings: SettingsDep,
    store: StoreDep,
    pool: PoolDep,
) -> Response:
    """The best layout for this cluster, failure state and model, now.

    The answer arrives within `options.time_limit_s` (at most the server's cap), counted from arrival:
    the best plan found by then, with its solver status and gap.
    """
    limit_s = settings.time_limit_s(request.options.time_limit_s)
    budget = Budget.starting_now(limit_s)
    calibration = await applied_calibration(store, pool, request.options, limit_s)
    answer = await pool.run(plan_answer, request, settings.max_time_limit_s, budget, calibration, deadline_s=limit_s)
    return await answer_with_plan(store, answer)


alias_router.add_api_route(
    "/plan", create_plan, methods=["POST"], response_model=Plan, responses=_ERRORS,
    openapi_extra=body_openapi(PlanRequest), summary="Create Plan (unversioned alias of POST /v1/plan)",
)


@router.post("/estimate", response_model=Plan, responses=_ERRORS,
             openapi_extra=body_openapi(EstimateRequest, estimate_examples()))
async def create_estimate(
    request: Annotated[EstimateRequest, json_body(EstimateRequest)],
    settings: SettingsDep,
    store: StoreDep,
    pool: PoolDep,
) -> Response:
    """The predicted performance of one fixed layout (no search)."""
    limit_s = settings.time_limit_s(request.options.time_limit_s)
    calibration = await applied_calibration(store, pool, request.options, limit_s)
    answer = await pool.run(estimate_answer, request, calibration, deadline_s=limit_s)
    return await answer_with_plan(store, answer)


async def stored_plan_json(plan_id: str, store: PlanStore) -> str:
    """The stored plan's JSON text, or 404."""
    stored = await run_in_threadpool(store.get_json, plan_id)
    if stored is None:
        raise HTTPException(status_code=404, detail=f"no plan with id {plan_id!r}")
    return stored


# Pieces a large stored plan is sent in: the event loop turns between them (health checks, other clients).
SEND_CHUNK_BYTES = 256 * 1024


@router.post("/compare", response_model=CompareResponse, responses=_ERRORS,
             openapi_extra=body_openapi(CompareRequest, estimate_examples()))
async def create_comparison(
    request: Annotated[CompareRequest, json_body(CompareRequest)],
    settings: SettingsDep,
    store: StoreDep,
    pool: PoolDep,
) -> Response:
    """The layout you run (`layout`, by shape, or your trainer's settings as `/v1/import` takes them) against the
    best plan for the same cluster, model and batch: both plans, the speed-up, and what each difference buys
    applied alone to your layout, best first. Both plans are stored: your layout's page (`/ui/plans/{id}`) shows
    the comparison, and links the best plan's."""
    options = getattr(request.root, "options", None)
    deadline_s = settings.time_limit_s((options or Options()).time_limit_s)
    calibration = await applied_calibration(store, pool, options, deadline_s)
    answer = await pool.run(compare_answer, request.root, calibration, deadline_s=deadline_s)
    for plan in answer.plans:
        try:
            await run_in_threadpool(store.save_json, plan.plan_id, plan.request_json, plan.plan_json)
        except StoreUnavailable as error:  # the comparison is still the answer; only its pages are lost
            log.error("compared plan %s not stored: %s", plan.plan_id, error)
    return Response(answer.response_json, media_type=JSON)


@router.get("/plans/{plan_id}", response_model=Plan, responses=_READ_ERRORS)
async def read_plan(plan_id: str, store: StoreDep) -> Response:
    """A stored plan, exactly as it was answered."""
    stored = await run_in_threadpool(store.get_json_bytes, plan_id)
    if stored is None:
        raise HTTPException(status_code=404, detail=f"no plan with id {plan_id!r}")
    if len(stored) <= SEND_CHUNK_BYTES:
        return Response(stored, media_type=JSON)
    return StreamingResponse(_chunks(memoryview(stored)), media_type=JSON,
                             headers={"Content-Length": str(len(stored))})


async def _chunks(body: memoryview):
    for start in range(0, len(body), SEND_CHUNK_BYTES):
        yield body[start:start + SEND_CHUNK_BYTES]


@router.get(
    "/plans/{plan_id}/export/{format_name}",
    response_class=Response,
    responses={**_READ_ERRORS, 422: {"model": ErrorDetail}, **SOLVE_RESPONSES},
)
async def export_stored_plan(
    plan_id: str,
    format_name: str,
    store: StoreDep,
    pool: PoolDep,
    settings: SettingsDep,
    replica: _ReplicaQuery = None,
) -> Response:
    """A stored plan in a trainer's format (see `resiplan export --help` for the formats)."""
    try:
        exporter = export_format(format_name)
    except ExportError:
        raise HTTPException(
            status_code=404, detail=f"unknown export format {format_name!r}; choose one of: {', '.join(format_names())}"
        ) from None
    plan_json = await stored_plan_json(plan_id, store)
    text = await pool.run(render_export, format_name, plan_json, replica, deadline_s=settings.render_time_limit_s)
    # A browser must not sniff a shell fragment or an SVG into something it runs.
    headers = {"X-Content-Type-Options": "nosniff", "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'"}
    return Response(content=text, media_type=exporter.media_type, headers=headers)


class ViewLinkRequest(BaseModel):
    ttl_s: int | None = Field(default=None, ge=10, le=MAX_VIEW_LINK_TTL_S,
                              description="Seconds the link stays valid; default RESIPLAN_VIEW_LINK_TTL_S.")


class ViewLink(BaseModel):
    url: str = Field(description="The plan page, signed: open it in a browser. Relative to the service's URL.")
    plan_json_url: str
    schedule_svg_url: str
    expires_unix_s: int
    signed: bool = Field(description="false when the service has no API token: the links need no signature.")


@router.post("/plans/{plan_id}/view-link", response_model=ViewLink, responses=_READ_ERRORS,
             openapi_extra=body_openapi(ViewLinkRequest))
async def create_view_link(plan_id: str, http: Request, store: StoreDep, settings: SettingsDep) -> ViewLink:
    """A short-lived signed link that opens this plan's page (and its JSON and schedule) in a browser,
    which cannot send the bearer token. An empty body takes the default lifetime."""
    raw = await http.body()
    options = await run_in_threadpool(_view_link_options, raw)
    await stored_plan_json(plan_id, store)
    token = settings.token()
    expires = int(time.time()) + (options.ttl_s or settings.view_link_ttl_s)
    query = f"?expires={expires}&signature={ViewLinks.for_token(token).signature(plan_id, expires)}" if token else ""
    return ViewLink(url=f"/ui/plans/{plan_id}{query}", plan_json_url=f"/v1/plans/{plan_id}{query}",
                    schedule_svg_url=f"/v1/plans/{plan_id}/schedule.svg{query}", expires_unix_s=expires,
                    signed=token is not None)


def _view_link_options(raw: bytes) -> ViewLinkRequest:
    return ViewLinkRequest() if not raw.strip() else parse_body(ViewLinkRequest, raw)
