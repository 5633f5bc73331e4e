"""/v1/plans/{id}/replan: move a running job to the best layout for the failure state now."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Body, HTTPException
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.deps import PoolDep, SettingsDep, StoreDep
from api.replanning import replan_answer, replan_request
from api.routes.plans import SOLVE_RESPONSES, V1_RESPONSES
from api.schemas import ErrorDetail, Plan, ReplanRequest

router = APIRouter(prefix="/v1", tags=["plans"], responses=V1_RESPONSES)

_EXAMPLE = {
    "failures": {"failed": ["3:5", "17:*"], "slow": [{"device": "9:2", "speed": 0.5}]},
    "options": {"time_limit_s": 10, "amortize_iterations": 500},
}


@router.post(
    "/plans/{plan_id}/replan",
    response_model=Plan,
    responses={404: {"model": ErrorDetail}, 422: {"model": ErrorDetail}, **SOLVE_RESPONSES},
)
async def replan_stored_plan(
    plan_id: str,
    body: Annotated[ReplanRequest, Body(openapi_examples={"new failures": {"value": _EXAMPLE}})],
    settings: SettingsDep,
    store: StoreDep,
    pool: PoolDep,
) -> JSONResponse:
    """A new plan for the complete failure state now, with `parent_plan_id` and `migration`: the state
    that moves from the running plan, chosen to minimize iteration time + migration time /
    `options.amortize_iterations` (default 500). Options not given are the parent request's."""
    parent_request = await run_in_threadpool(store.get_request, plan_id)
    parent_plan = await run_in_threadpool(store.get, plan_id)
    if parent_request is None or parent_plan is None:
        raise HTTPException(status_code=404, detail=f"no plan with id {plan_id!r}")
    request = replan_request(parent_request, body)
    limit_s = settings.time_limit_s(request.options.time_limit_s)
    answer = await pool.run(replan_answer, request, parent_plan, settings.max_time_limit_s,
                            time.monotonic() + limit_s, deadline_s=limit_s)
    await run_in_threadpool(store.save, answer.plan_id, request.model_dump(mode="json"), answer.plan)
    return JSONResponse(answer.plan)
