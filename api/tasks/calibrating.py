"""Measured runs and roles -> a stored calibration (the calibrations route and `resiplan calibrate`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from api.tasks.planning import new_plan_id
from cost_models.efficiency import fitted_efficiency
from cost_models.gpu_efficiency import builtin_efficiency
from cost_models.layout import ParallelShape
from planner.calibration import (
    RUN_NOISE_LOG,
    MeasuredCompute,
    MeasuredRun,
    calibrate,
    exact_predicted_s,
    predicted_s,
)
from planner.calibration_span import joined_span, measured_span
from planner.errors import PlanningError
from wire.calibration import (
    AppliedCalibration,
    CalibratedRun,
    Calibration,
    CalibrationCoverage,
    CalibrationRefit,
    CalibrationRequest,
    parameter_bounds,
)
from wire.convert import to_fixed_layout, to_problem
from wire.schemas import EstimateRequest, Plan, PlanRequest


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


@dataclass(frozen=True)
class StoredPlan:
    """A plan the service answered, with the request it answered: what a role's measured compute refers to."""

    request: dict[str, Any]
    plan: dict[str, Any]


def _measured_roles(request: CalibrationRequest, plans: Mapping[str, StoredPlan]) -> list[tuple[str, MeasuredCompute]]:
    """(source, measurement) of every role with a time model: its compute for one microbatch of the plan's
    sequences, alpha x tokens + beta x squared lengths."""
    out = []
    for i, measured in enumerate(request.roles):
        stored = plans.get(measured.plan_id)
        if stored is None:
            raise PlanningError(f"roles[{i}].plan_id {measured.plan_id!r} names no stored plan (roles are fitted "
                                "by the service, which stores the plans: POST /v1/calibrations)")
        body = {**stored.request, "options": {**stored.request.get("options", {}), "calibration_id": None}}
        try:
            problem = to_problem((EstimateRequest if "layout" in body else PlanRequest).model_validate(body))
        except (ValidationError, PlanningError) as error:
            raise PlanningError(f"roles[{i}]: the request of plan {measured.plan_id!r} no longer plans: {error}") from None
        plan = Plan.model_validate(stored.plan)
        seq, mbs = problem.workload.seq_length, plan.micro_batch_size
        for j, role in enumerate(measured.time_models):
            if role.alpha_ms_per_token is None:
                continue  # no device of the role reported work
            first, end = role.layers
            found = [(replica, stage) for replica in plan.replicas for stage in replica.stages
                     if tuple(stage.layers) == (first, end) and stage.tp == role.tp]
            if not found:
                raise PlanningError(f"roles[{i}].time_models[{j}]: no stage of plan {measured.plan_id!r} holds "
                                    f"layers [{first}, {end}) at tp {role.tp}")
            replica, stage = found[0]
            shape = ParallelShape(tp=stage.tp, pp=len(replica.stages), dp=len(plan.replicas), micro_batch_size=mbs,
                                  recompute=plan.recompute, cp=stage.cp, ep=plan.ep, etp=plan.etp)
            measured_ms = (role.alpha_ms_per_token * mbs * seq
                           + (role.beta_ms_per_token_squared or 0.0) * mbs * seq * seq)
            if measured_ms <= 0:
                raise PlanningError(f"roles[{i}].time_models[{j}]: measures no compute (alpha and beta 0)")
            out.append((f"roles[{i}].time_models[{j}]", MeasuredCompute(
                problem, shape, end - first, first == 0, end == problem.workload.model.num_layers, measured_ms / 1e3)))
    return out


def calibration_for(request: CalibrationRequest, plans: Mapping[str, StoredPlan] | None = None) -> Calibration:
    """Fit the built-in parameters to the request's runs and measured roles (`plans`: the stored plans the roles
    name); a run that cannot be estimated is a PlanningError naming it."""
    return _fitted(request, new_plan_id(), plans or {})


def _fitted(request: CalibrationRequest, calibration_id: str, plans: Mapping[str, StoredPlan]) -> Calibration:
    sources = [f"runs[{i}]" for i in range(len(request.runs))]
    roles = _measured_roles(request, plans)
    runs = [*_measured_runs(request), *(measurement for _, measurement in roles)]
    sources += [source for source, _ in roles]
    notes = [f"{source}: its attention factor was not measured (source prior: the detector's window could not "
             "pin it), so its compute at the plan's full sequence length uses the cost model's attention-to-linear "
             "ratio; send a longer telemetry window to measure it" for source in _unmeasured_attention(request)]
    # The built-in parameters of the runs' GPU (the first run's, where runs on several GPUs are fitted together).
    start = builtin_efficiency(runs[0].problem.hardware.gpu) if runs else fitted_efficiency()
    try:
        fit = calibrate(runs, start)
    except PlanningError as error:  # a layout priced at some parameters but not at others
        raise PlanningError(f"runs: {error}") from None
    if not fit.fitted:
        raise PlanningError(
            "the runs cannot determine any efficiency parameter (unidentified: " + ", ".join(fit.unidentified)
            + "): their predicted times barely depend on them; measure runs that differ in model size or layout")
    if fit.cross_validated_mape is not None and fit.cross_validated_mape > fit.default_mape:
        notes.append(
            f"each run predicted by a fit to the others is {fit.cross_validated_mape:.1%} off on average, more than "
            f"the default parameters price them ({fit.default_mape:.1%}): what these runs teach does not carry from "
            "some of them to the others, so plans priced with this calibration may be further off than uncalibrated "
            "ones; calibrate on more runs, or on runs like the layouts you will plan")
    if round(fit.fit_weight, 5) < 1:
        notes.append(_shrinkage_note(round(fit.fit_weight, 5), len(fit.runs)))
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
        runs=[CalibratedRun(source=source, measured_s=run.measured_s, predicted_s=round(run.predicted_s, 6),
                            error=round(run.error, 5),
                            cross_validated_predicted_s=round(other.predicted_s, 6) if other else None,
                            cross_validated_error=round(other.error, 5) if other else None)
              for source, run, other in zip(sources, fit.runs, held_out)],
        fit_mape=round(fit.fit_mape, 5),
        cross_validated_mape=round(fit.cross_validated_mape, 5) if fit.cross_validated_mape is not None else None,
        default_mape=round(fit.default_mape, 5),
        fit_weight=round(fit.fit_weight, 5),
        covers=CalibrationCoverage.of(joined_span(measured_span(run) for run in runs)),
        notes=notes,
    )


def _shrinkage_note(fit_weight: float, runs: int) -> str:
    noise = f"the cost model's own error per run (about {math.expm1(RUN_NOISE_LOG):.0%} on a calibrated published stack)"
    if fit_weight == 0:
        return ("the parameters stay at their defaults: the change the best fit makes to these runs' predictions is "
                f"within what {noise} explains for the parameters fitted, so the fit would chase that error; runs "
                "further off, or more of them, move the parameters")
    share = "under 1%" if fit_weight < 0.005 else "over 99%" if fit_weight >= 0.995 else f"{fit_weight:.0%}"
    return (f"the parameters take {share} of the move that fits the runs best: {runs} run"
            f"{'s' if runs > 1 else ''} this far off the defaults could owe the rest to {noise}; more runs take more")


def _unmeasured_attention(request: CalibrationRequest) -> list[str]:
    """Sources of the roles whose attention factor is the cost model's (`/v1/detect` source `prior`)."""
    return [f"roles[{i}].time_models[{j}]" for i, measured in enumerate(request.roles)
            for j, role in enumerate(measured.time_models)
            if role.source == "prior" and role.alpha_ms_per_token is not None]


@dataclass(frozen=True)
class CalibrationAnswer:
    calibration_id: str
    calibration_json: str


def calibration_answer(request: CalibrationRequest, plans: Mapping[str, StoredPlan]) -> CalibrationAnswer:
    """calibration_for, for a solver worker."""
    calibration = calibration_for(request, plans)
    return CalibrationAnswer(calibration.calibration_id, calibration.model_dump_json())


def stored_runs_json(request: CalibrationRequest, plans: Mapping[str, StoredPlan]) -> str:
    """What a calibration keeps to be refitted later: its request and the plans its roles name."""
    return json.dumps({"request": request.model_dump(mode="json"),
                       "plans": {plan_id: {"request": plan.request, "plan": plan.plan} for plan_id, plan in plans.items()}})


def _stored_runs(runs_json: str) -> tuple[CalibrationRequest, dict[str, StoredPlan]]:
    stored = json.loads(runs_json)
    plans = {plan_id: StoredPlan(plan["request"], plan["plan"]) for plan_id, plan in stored.get("plans", {}).items()}
    return CalibrationRequest.model_validate(stored["request"]), plans


# A run whose prediction under the stored parameters moved by more than this since the fit was priced by another
# cost model. Rounding (parameters to 6 decimals, times to the microsecond) moves a prediction far less.
STALE_PREDICTION_REL = 1e-4


def refreshed_calibration(calibration_json: str, runs_json: str) -> str | None:
    """A stored calibration refitted to its own runs when the current cost model predicts them differently under
    its stored parameters: the parameters were fitted to another model's prices, and applying them to this one's
    would mislead every plan; one stored without its span (`covers`) gets it. None while the stored fit still
    holds; a PlanningError naming the calibration when
    its runs cannot be priced or fitted any more."""
    stored = Calibration.model_validate_json(calibration_json)
    where = f"calibration {stored.calibration_id!r} ({stored.name})"
    try:
        request, plans = _stored_runs(runs_json)
        runs = [*_measured_runs(request), *(measurement for _, measurement in _measured_roles(request, plans))]
    except (ValidationError, PlanningError) as error:
        raise PlanningError(f"{where} was fitted under an earlier cost model, and its runs cannot be priced by "
                            f"this one ({error}); POST /v1/calibrations with runs this version accepts") from None
    parameters = AppliedCalibration.of(stored).parameters
    moved = [exact_predicted_s(run, parameters) / fitted.predicted_s - 1 for run, fitted in zip(runs, stored.runs)]
    largest = max(range(len(moved)), key=lambda i: abs(moved[i]))
    if abs(moved[largest]) <= STALE_PREDICTION_REL:
        if stored.covers is not None and None not in (stored.covers.nvlink_topologies, stored.covers.zero_sharding):
            return None
        # Stored before fits said what their runs span (or how their nodes were linked, or where they sharded):
        # the same fit, now with it.
        covers = CalibrationCoverage.of(joined_span(measured_span(run) for run in runs))
        return stored.model_copy(update={"covers": covers}).model_dump_json()
    try:
        refit = _fitted(request, stored.calibration_id, plans)
    except PlanningError as error:
        raise PlanningError(f"{where} was fitted under an earlier cost model and cannot be refitted under this "
                            f"one: {error}") from None
    replaced = CalibrationRefit(
        reason=f"the cost model changed since the fit: under the stored parameters it prices runs[{largest}] "
               f"{moved[largest]:+.2%} against the fit's prediction",
        previous_parameters=stored.parameters, previous_fit_mape=stored.fit_mape)
    return refit.model_copy(update={"refit": replaced}).model_dump_json()
