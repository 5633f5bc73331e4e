"""/v1/calibrations: fit the cost model to iteration times measured on the user's cluster, and keep the fit."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.core.body import body_openapi, json_body
from api.deps import PoolDep, SettingsDep, StoreDep
from api.routes.calibration_lookup import current_calibration_json
from api.routes.plans import JSON, SOLVE_RESPONSES, V1_RESPONSES
from api.tasks.calibrating import StoredPlan, calibration_answer, stored_runs_json
from wire.calibration import Calibration, CalibrationRequest
from wire.schemas import ErrorDetail

router = APIRouter(prefix="/v1", tags=["calibrations"], responses=V1_RESPONSES)


@router.post("/calibrations", response_model=Calibration, status_code=201,
             responses={422: {"model": ErrorDetail}, **SOLVE_RESPONSES}, openapi_extra=body_openapi(CalibrationRequest))
async def create_calibration(
    request: Annotated[CalibrationRequest, json_body(CalibrationRequest)],
    settings: SettingsDep,
    store: StoreDep,
    pool: PoolDep,
) -> Response:
    """Fit the cost model's efficiency parameters to measured runs (each a `/v1/estimate` request plus
    `measured_iteration_time_s`) and to per-role compute `/v1/detect` measured on jobs running stored plans
    (`roles`), and store the fit: its parameters, which the runs determined and which they cannot, per-run and
    leave-one-out errors. `options.calibration_id` on plan, estimate and replan applies it."""
    plans = {}
    for i, measured in enumerate(request.roles):
        plan_json = await run_in_threadpool(store.get_json, measured.plan_id)
        plan_request = await run_in_threadpool(store.get_request, measured.plan_id)
        if plan_json is None or plan_request is None:
            raise HTTPException(status_code=422, detail=f"roles[{i}].plan_id {measured.plan_id!r} names no stored "
                                                        "plan (the plan the detected job runs)")
        plans[measured.plan_id] = StoredPlan(plan_request, await run_in_threadpool(json.loads, plan_json))
    answer = await pool.run(calibration_answer, request, plans, deadline_s=settings.max_time_limit_s)
    # The referenced plans are stored beside the runs: serializing a large plan takes tens of milliseconds.
    runs_json = await run_in_threadpool(stored_runs_json, request, plans)
    await run_in_threadpool(store.save_calibration, answer.calibration_id, answer.calibration_json, runs_json)
    return Response(answer.calibration_json, status_code=201, media_type=JSON)


@router.get("/calibrations/{calibration_id}", response_model=Calibration, responses={404: {"model": ErrorDetail}})
async def read_calibration(calibration_id: str, settings: SettingsDep, store: StoreDep, pool: PoolDep) -> Response:
    """A stored calibration. When the cost model changed since its runs were fitted, they are refitted first (and
    stored so): the answer's `refit` holds the parameters the new fit replaced."""
    stored = await current_calibration_json(store, pool, calibration_id, settings.max_time_limit_s)
    if stored is None:
        raise HTTPException(status_code=404, detail=f"no calibration with id {calibration_id!r}")
    # Through the model, so that one stored before a field was added answers it as null, as documented.
    return Response(await run_in_threadpool(_as_current, stored), media_type=JSON)


def _as_current(calibration_json: str) -> str:
    return Calibration.model_validate_json(calibration_json).model_dump_json()
