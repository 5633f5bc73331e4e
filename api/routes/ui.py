"""Human-facing views of a stored plan: the schedule as SVG and a one-page HTML overview.

Both are rendered in the solver pool (api.tasks.rendering). With auth on they need the token or a signed view
link (api.core.auth); the page then signs its own links to the plan's other views.
"""

from __future__ import annotations

import time
from html import escape
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from adapters.registry import export_format
from api.core.auth import ViewLinks, signed_view_query
from api.deps import PoolDep, SettingsDep, StoreDep
from api.routes.plans import SOLVE_RESPONSES, V1_RESPONSES, stored_plan_json
from api.tasks.rendering import render_export, render_plan_page
from render.gantt_zoom_script import SCRIPT_CSP_SOURCE
from wire.schemas import ErrorDetail

router = APIRouter(tags=["ui"], responses=V1_RESPONSES)

# Defence in depth behind the renderers' escaping: the page may run only its own zoom script (by hash) and
# load nothing from anywhere; an SVG opened on its own runs nothing at all.
PAGE_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {SCRIPT_CSP_SOURCE}; style-src 'unsafe-inline'; "
                               "img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # a view link's signature must not leak to another site
}
SVG_HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
               "X-Content-Type-Options": "nosniff"}

_ReplicaQuery = Annotated[int | None, Query(ge=0, le=2**31, description="Replica id; default the slowest replica.")]
_LinkQuery = Annotated[str | None, Query(max_length=64, description="With auth on: a view link's parameter.")]


@router.get(
    "/v1/plans/{plan_id}/schedule.svg",
    response_class=Response,
    responses={
        200: {"content": {"image/svg+xml": {}}, "description": "Gantt chart of one replica's pipeline schedule."},
        404: {"model": ErrorDetail},
        422: {"model": ErrorDetail, "description": "The plan has no pipeline schedule, or no such replica."},
        **SOLVE_RESPONSES,
    },
)
async def schedule_svg(
    plan_id: str, store: StoreDep, pool: PoolDep, settings: SettingsDep, replica: _ReplicaQuery = None,
    expires: _LinkQuery = None, signature: _LinkQuery = None,
) -> Response:
    """The stored plan's pipeline schedule as a self-contained SVG Gantt chart."""
    plan_json = await stored_plan_json(plan_id, store)
    text = await pool.run(render_export, "svg", plan_json, replica, deadline_s=settings.render_time_limit_s)
    return Response(content=text, media_type=export_format("svg").media_type, headers=SVG_HEADERS)


@router.get(
    "/ui/plans/{plan_id}",
    response_class=HTMLResponse,
    responses={
        404: {"content": {"text/html": {}}},
        # JSON, unlike the page (a `model` here would be filed under text/html).
        422: {
            "description": "No such replica, or a malformed query.",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorDetail"}}},
        },
        **SOLVE_RESPONSES,
    },
)
async def plan_page(
    plan_id: str, http: Request, store: StoreDep, pool: PoolDep, settings: SettingsDep,
    replica: _ReplicaQuery = None, expires: _LinkQuery = None, signature: _LinkQuery = None,
) -> HTMLResponse:
    """The stored plan as an HTML page: headline numbers, per-stage table, cluster map, Gantt chart."""
    plan_json = await run_in_threadpool(store.get_json, plan_id)
    if plan_json is None:
        return HTMLResponse(_not_found(plan_id), status_code=404)
    html = await pool.run(render_plan_page, plan_json, replica, _link_query(http, plan_id, settings),
                          deadline_s=settings.render_time_limit_s)
    return HTMLResponse(html, headers=PAGE_HEADERS)


def _link_query(http: Request, plan_id: str, settings) -> dict[str, str] | None:
    """What the page's links to the plan's other views must carry: nothing without auth; the link the page
    was opened with; or, opened with the bearer token, a new link with the default lifetime."""
    token = settings.token()
    if token is None:
        return None
    return signed_view_query(http.scope) or ViewLinks.for_token(token).query(
        plan_id, int(time.time()) + settings.view_link_ttl_s)


def _not_found(plan_id: str) -> str:
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>plan not found</title></head>"
            f"<body><h1>No plan with id {escape(plan_id)}</h1><p>Plans are created by POST /v1/plan.</p></body></html>")
