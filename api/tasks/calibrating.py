"""Measured runs -> a stored calibration (the calibrations route and `resiplan calibrate`)."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from api.tasks.planning import new_plan_id
from cost_models.efficiency import fitted_efficiency
from planner.calibration import MeasuredRun, calibrate, predicted_s
from planner.errors import PlanningError
from wire.calibration import (
    AppliedCalibration,
    CalibratedRun,
    Calibration,
    CalibrationRefit,
    CalibrationRequest,
    parameter_bounds,
)
from wire.convert import to_fixed_layout, to_problem


def _measured_runs(request: CalibrationRequest) -> list[MeasuredRun]:
    runs = []
    for i, run in enumerate(request.runs):
        if run.options.calibration_id is not None:
            raise PlanningError(f"runs[{i}].options.calibration_id: runs are fitted from the built-in parameters; "
                                "leave it out")
        try:
            measured = MeasuredRun(to_problem(run), to_fixed_layout(run.layout), run.measured_iteration_time_s)
            predicted_s(measured, measured.problem.efficiency)  # a layout that cannot run is this run's error
        except PlanningError as error:
            raise PlanningError(f"runs[{i}]: {error}") from None
        runs.append(measured)
    return runs


def calibration_for(request: CalibrationRequest) -> Calibration:
    """Fit the built-in parameters to the request's runs; a run that cannot be estimated is a PlanningError
    naming it."""
    return _fitted(request, new_plan_id())


def _fitted(request: CalibrationRequest, calibration_id: str) -> Calibration:
    runs = _measured_runs(request)
    start = fitted_efficiency()
    try:
        fit = calibrate(runs, start)
    except PlanningError as error:  # a layout priced at some parameters but not at others
        raise PlanningError(f"runs: {error}") from None
    if not fit.fitted:
        raise PlanningError(
            "the runs cannot determine any efficiency parameter (unidentified: " + ", ".join(fit.unidentified)
            + "): their predicted times barely depend on them; measure runs that differ in model size or layout")
    held_out = fit.cross_validated or (None,) * len(fit.runs)
    return Calibration(
        calibration_id=calibration_id,
        name=request.name,
        parameters={name: round(value, 6) for name, value in fit.parameters.to_dict().items()},
        default_parameters=start.to_dict(),
        fitted=list(fit.fitted),
        unidentified=list(fit.unidentified),
        at_bound=list(fit.at_bound),
        bounds=parameter_bounds(),
        runs=[CalibratedRun(measured_s=run.measured_s, predicted_s=round(run.predicted_s, 6), error=round(run.error, 5),
                            cross_validated_predicted_s=round(other.predicted_s, 6) if other else None,
                            cross_validated_error=round(other.error, 5) if other else None)
              for run, other in zip(fit.runs, held_out)],
        fit_mape=round(fit.fit_mape, 5),
        cross_validated_mape=round(fit.cross_validated_mape, 5) if fit.cross_validated_mape is not None else None,
    )


@dataclass(frozen=True)
class CalibrationAnswer:
    calibration_id: str
    calibration_json: str


def calibration_answer(request: CalibrationRequest) -> CalibrationAnswer:
    """calibration_for, for a solver worker."""
    calibration = calibration_for(request)
    return CalibrationAnswer(calibration.calibration_id, calibration.model_dump_json())


# A run whose prediction under the stored parameters moved by more than this since the fit was priced by another
# cost model. Rounding (parameters to 6 decimals, times to the microsecond) moves a prediction far less.
STALE_PREDICTION_REL = 1e-4


def refreshed_calibration(calibration_json: str, runs_json: str) -> str | None:
    """A stored calibration refitted to its own runs when the current cost model predicts them differently under
    its stored parameters: the parameters were fitted to another model's prices, and applying them to this one's
    would mislead every plan. None while the stored fit still holds; a PlanningError naming the calibration when
    its runs cannot be priced or fitted any more."""
    stored = Calibration.model_validate_json(calibration_json)
    where = f"calibration {stored.calibration_id!r} ({stored.name})"
    try:
        request = CalibrationRequest.model_validate_json(runs_json)
        runs = _measured_runs(request)
    except (ValidationError, PlanningError) as error:
        raise PlanningError(f"{where} was fitted under an earlier cost model, and its runs cannot be priced by "
                            f"this one ({error}); POST /v1/calibrations with runs this version accepts") from None
    parameters = AppliedCalibration.of(stored).parameters
    moved = [predicted_s(run, parameters) / fitted.predicted_s - 1 for run, fitted in zip(runs, stored.runs)]
    largest = max(range(len(moved)), key=lambda i: abs(moved[i]))
    if abs(moved[largest]) <= STALE_PREDICTION_REL:
        return None
    try:
        refit = _fitted(request, stored.calibration_id)
    except PlanningError as error:
        raise PlanningError(f"{where} was fitted under an earlier cost model and cannot be refitted under this "
                            f"one: {error}") from None
    replaced = CalibrationRefit(
        reason=f"the cost model changed since the fit: under the stored parameters it prices runs[{largest}] "
               f"{moved[largest]:+.2%} against the fit's prediction",
        previous_parameters=stored.parameters, previous_fit_mape=stored.fit_mape)
    return refit.model_copy(update={"refit": replaced}).model_dump_json()
