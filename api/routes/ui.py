"""Human-facing views of a stored plan: the schedule as SVG and a one-page HTML overview."""

from __future__ import annotations

from html import escape
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from adapters.plan_page import plan_page_html
from adapters.registry import export_format
from api.deps import StoreDep
from api.routes.plans import stored_plan
from api.schemas import ErrorDetail, Plan

router = APIRouter(tags=["ui"])

_ReplicaQuery = Annotated[int | None, Query(description="Replica id; default the slowest replica.")]


@router.get(
    "/v1/plans/{plan_id}/schedule.svg",
    response_class=Response,
    responses={
        200: {"content": {"image/svg+xml": {}}, "description": "Gantt chart of one replica's pipeline schedule."},
        404: {"model": ErrorDetail},
        422: {"model": ErrorDetail, "description": "The plan has no pipeline schedule, or no such replica."},
    },
)
async def schedule_svg(plan_id: str, store: StoreDep, replica: _ReplicaQuery = None) -> Response:
    """The stored plan's pipeline schedule as a self-contained SVG Gantt chart."""
    plan = await stored_plan(plan_id, store)
    exporter = export_format("svg")
    text = await run_in_threadpool(exporter.render, plan, replica)
    return Response(content=text, media_type=exporter.media_type)


@router.get(
    "/ui/plans/{plan_id}",
    response_class=HTMLResponse,
    responses={
        404: {"content": {"text/html": {}}},
        # JSON, unlike the page (a `model` here would be filed under text/html), and not FastAPI's default
        # 422 schema: a replica the plan lacks is a PlanningError with a string detail.
        422: {
            "description": "No such replica, or a malformed query.",
            "content": {"application/json": {"schema": ErrorDetail.model_json_schema()}},
        },
    },
)
async def plan_page(plan_id: str, store: StoreDep, replica: _ReplicaQuery = None) -> HTMLResponse:
    """The stored plan as an HTML page: headline numbers, cluster map, Gantt chart."""
    stored = await run_in_threadpool(store.get, plan_id)
    if stored is None:
        return HTMLResponse(_not_found(plan_id), status_code=404)
    plan = Plan.model_validate(stored)
    slow_speeds = {slow.device: slow.speed for slow in plan.slow_devices}
    return HTMLResponse(await run_in_threadpool(plan_page_html, plan, replica, slow_speeds))


def _not_found(plan_id: str) -> str:
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>plan not found</title></head>"
            f"<body><h1>No plan with id {escape(plan_id)}</h1><p>Plans are created by POST /v1/plan.</p></body></html>")
