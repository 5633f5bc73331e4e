"""/v1/plan, /v1/estimate, /v1/plans/{id} and its exports."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, Query
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from adapters.registry import ExportError, export_format, format_names
from api.deps import SettingsDep, StoreDep
from api.examples import estimate_examples, scenario_examples
from api.schemas import ErrorDetail, EstimateRequest, Plan, PlanRequest
from api.service import estimate_for, plan_for

router = APIRouter(prefix="/v1", tags=["plans"])

_ERRORS = {422: {"model": ErrorDetail, "description": "Malformed or unsatisfiable request; `detail` says why."}}


@router.post("/plan", response_model=Plan, responses=_ERRORS)
async def create_plan(
    request: Annotated[PlanRequest, Body(openapi_examples=scenario_examples())],
    settings: SettingsDep,
    store: StoreDep,
) -> Plan:
    """The best layout for this cluster, failure state and model, now."""
    plan = await run_in_threadpool(plan_for, request, settings.max_time_limit_s)
    await run_in_threadpool(store.save, plan.plan_id, request.model_dump(mode="json"), plan.model_dump(mode="json"))
    return plan


@router.post("/estimate", response_model=Plan, responses=_ERRORS)
async def create_estimate(
    request: Annotated[EstimateRequest, Body(openapi_examples=estimate_examples())],
    store: StoreDep,
) -> Plan:
    """The predicted performance of one fixed layout (no search)."""
    plan = await run_in_threadpool(estimate_for, request)
    await run_in_threadpool(store.save, plan.plan_id, request.model_dump(mode="json"), plan.model_dump(mode="json"))
    return plan


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
