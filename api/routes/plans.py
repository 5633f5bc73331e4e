"""/v1/plan, /v1/estimate, /v1/plans/{id} and its exports."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, Query
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from adapters.registry import ExportError, export_format, format_names
from api.deps import PoolDep, SettingsDep, StoreDep
from api.examples import estimate_examples, scenario_examples
from api.schemas import ErrorDetail, EstimateRequest, Plan, PlanRequest
from api.service import estimate_answer, plan_answer

# Statuses any /v1 route may answer (401 only when the server has an API token).
V1_RESPONSES = {401: {"model": ErrorDetail, "description": "Missing or wrong `Authorization: Bearer <token>`."}}
# And those of a route that solves in the worker pool.
SOLVE_RESPONSES = {
    413: {"model": ErrorDetail, "description": "Request body over this route's size limit."},
    503: {"model": ErrorDetail, "description": "All solver workers busy and the queue full, or the solver process "
          "failed; retry after `Retry-After` seconds."},
    504: {"model": ErrorDetail, "description": "No answer within the deadline plus the grace period; the solve was stopped."},
}

router = APIRouter(prefix="/v1", tags=["plans"], responses=V1_RESPONSES)

_ERRORS = {
    422: {"model": ErrorDetail, "description": "Malformed or unsatisfiable request; `detail` says why."},
    **SOLVE_RESPONSES,
}


@router.post("/plan", response_model=Plan, responses=_ERRORS)
async def create_plan(
    request: Annotated[PlanRequest, Body(openapi_examples=scenario_examples())],
    settings: SettingsDep,
    store: StoreDep,
    pool: PoolDep,
) -> JSONResponse:
    """The best layout for this cluster, failure state and model, now.

    The answer arrives within `options.time_limit_s` (at most the server's cap), counted from arrival:
    the best plan found by then, with its solver status and gap.
    """
    limit_s = settings.time_limit_s(request.options.time_limit_s)
    answer = await pool.run(plan_answer, request, settings.max_time_limit_s, time.monotonic() + limit_s,
                            deadline_s=limit_s)
    await run_in_threadpool(store.save, answer.plan_id, request.model_dump(mode="json"), answer.plan)
    return JSONResponse(answer.plan)


@router.post("/estimate", response_model=Plan, responses=_ERRORS)
async def create_estimate(
    request: Annotated[EstimateRequest, Body(openapi_examples=estimate_examples())],
    settings: SettingsDep,
    store: StoreDep,
    pool: PoolDep,
) -> JSONResponse:
    """The predicted performance of one fixed layout (no search)."""
    answer = await pool.run(estimate_answer, request, deadline_s=settings.time_limit_s(request.options.time_limit_s))
    await run_in_threadpool(store.save, answer.plan_id, request.model_dump(mode="json"), answer.plan)
    return JSONResponse(answer.plan)


async def stored_plan(plan_id: str, store) -> Plan:
    stored = await run_in_threadpool(store.get, plan_id)
    if stored is None:
        raise HTTPException(status_code=404, detail=f"no plan with id {plan_id!r}")
    return Plan.model_validate(stored)


@router.get("/plans/{plan_id}", response_model=Plan, responses={404: {"model": ErrorDetail}})
async def read_plan(plan_id: str, store: StoreDep) -> Plan:
    return await stored_plan(plan_id, store)


@router.get(
    "/plans/{plan_id}/export/{format_name}",
    response_class=Response,
    responses={404: {"model": ErrorDetail}, 422: {"model": ErrorDetail}},
)
async def export_stored_plan(
    plan_id: str,
    format_name: str,
    store: StoreDep,
    replica: Annotated[int | None, Query(description="Replica id; default the slowest replica.")] = None,
) -> Response:
    """A stored plan in a trainer's format (see `resiplan export --help` for the formats)."""
    try:
        exporter = export_format(format_name)
    except ExportError:
        raise HTTPException(
            status_code=404, detail=f"unknown export format {format_name!r}; choose one of: {', '.join(format_names())}"
        ) from None
    plan = await stored_plan(plan_id, store)
    text = await run_in_threadpool(exporter.render, plan, replica)
    return Response(content=text, media_type=exporter.media_type)
