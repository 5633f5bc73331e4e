"""The stored calibration a request names, brought up to date with the cost model before anything is priced."""

from __future__ import annotations

from fastapi import HTTPException
from starlette.concurrency import run_in_threadpool

from api.core.execution import SolverPool
from api.core.store import PlanStore
from api.tasks.calibrating import refreshed_calibration
from wire.calibration import AppliedCalibration, Calibration
from wire.schemas import Options


async def current_calibration_json(store: PlanStore, pool: SolverPool, calibration_id: str,
                                   deadline_s: float) -> str | None:
    """The stored calibration's JSON, refitted to its own runs (and stored so) when the cost model changed since
    it was fitted; None when no calibration has that id. Calibrations stored before the service kept their runs
    are answered as stored."""
    stored = await run_in_threadpool(store.get_calibration_json, calibration_id)
    if stored is None:
        return None
    runs = await run_in_threadpool(store.get_calibration_runs_json, calibration_id)
    if runs is None:
        return stored
    refitted = await pool.run(refreshed_calibration, stored, runs, deadline_s=deadline_s)
    if refitted is None:
        return stored
    await run_in_threadpool(store.replace_calibration_json, calibration_id, refitted)
    return refitted


async def applied_calibration(store: PlanStore, pool: SolverPool, options: Options | None,
                              deadline_s: float) -> AppliedCalibration | None:
    """The stored calibration `options.calibration_id` names (None without one); a 422 when none is stored."""
    wanted = options.calibration_id if options is not None else None
    if wanted is None:
        return None
    stored = await current_calibration_json(store, pool, wanted, deadline_s)
    if stored is None:
        raise HTTPException(status_code=422, detail=f"options.calibration_id {wanted!r} names no stored calibration "
                                                    "(POST /v1/calibrations answers the id of one)")
    return AppliedCalibration.of(Calibration.model_validate_json(stored))
