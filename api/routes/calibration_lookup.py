"""The stored calibration a request's `options.calibration_id` names, read before its task is queued."""

from __future__ import annotations

from fastapi import HTTPException
from starlette.concurrency import run_in_threadpool

from api.core.store import PlanStore
from wire.calibration import AppliedCalibration, Calibration
from wire.schemas import Options


async def applied_calibration(store: PlanStore, options: Options | None) -> AppliedCalibration | None:
    """The stored calibration `options.calibration_id` names (None without one); a 422 when none is stored."""
    wanted = options.calibration_id if options is not None else None
    if wanted is None:
        return None
    stored = await run_in_threadpool(store.get_calibration_json, wanted)
    if stored is None:
        raise HTTPException(status_code=422, detail=f"options.calibration_id {wanted!r} names no stored calibration "
                                                    "(POST /v1/calibrations answers the id of one)")
    return AppliedCalibration.of(Calibration.model_validate_json(stored))
