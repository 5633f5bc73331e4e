"""/v1/plans/{id}/replan: move a running job to the best layout for the failure state now."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.core.body import body_openapi, json_body
from api.deps import PoolDep, SettingsDep, StoreDep
from api.routes.plans import (
    SOLVE_RESPONSES,
    V1_RESPONSES,
    answer_with_plan,
    stored_plan_json,
)
from api.routes.calibration_lookup import applied_calibration
from api.tasks.replanning import replan_answer
from planner.budget import Budget
from wire.schemas import ErrorDetail, Options, Plan, ReplanRequest

router = APIRouter(prefix="/v1", tags=["plans"], responses=V1_RESPONSES)

_EXAMPLE = {
    "failures": {"failed": ["3:5", "17:*"], "slow": [{"device": "9:2", "speed": 0.5}]},
    "options": {"time_limit_s": 10, "amortize_iterations": 500},
}


@router.post(
    "/plans/{plan_id}/replan",
    response_model=Plan,
    responses={404: {"model": ErrorDetail}, 422: {"model": ErrorDetail}, **SOLVE_RESPONSES},
    openapi_extra=body_openapi(ReplanRequest, {"new failures": {"value": _EXAMPLE}}),
)
async def replan_stored_plan(
    plan_id: str,
    body: Annotated[ReplanRequest, json_body(ReplanRequest)],
    settings: SettingsDep,
    store: StoreDep,
    pool: PoolDep,
) -> Response:
    """A new plan for the complete failure state now, with `parent_plan_id` and `migration`: the state
    that moves from the running plan, chosen to minimize iteration time + migration time /
    `options.amortize_iterations` (default 500). Options not given are the parent request's."""
    parent_plan = await stored_plan_json(plan_id, store)
    parent_request = await run_in_threadpool(store.get_request, plan_id)
    if parent_request is None:
        raise HTTPException(status_code=404, detail=f"no plan with id {plan_id!r}")
    # The budget: the caller's time limit, else the parent request's (the merge is validated in the worker).
    if body.options is not None and "time_limit_s" in body.options.model_fields_set:
        requested_s = body.options.time_limit_s
    else:
        requested_s = parent_request.get("options", {}).get("time_limit_s", Options().time_limit_s)
    limit_s = settings.time_limit_s(requested_s)
    budget = Budget.starting_now(limit_s)
    # The calibration: the caller's, else the parent request's (its id was checked when the parent was planned).
    if body.options is not None and "calibration_id" in body.options.model_fields_set:
        calibration = await applied_calibration(store, pool, body.options, limit_s)
    else:
        calibration = await applied_calibration(store, pool, Options.model_validate(
            {"calibration_id": parent_request.get("options", {}).get("calibration_id")}), limit_s)
    answer = await pool.run(replan_answer, parent_request, body, parent_plan, settings.max_time_limit_s,
                            budget, calibration, deadline_s=limit_s)
    return await answer_with_plan(store, answer)

