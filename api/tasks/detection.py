"""POST /v1/detect in a solver worker: telemetry body + stored plan -> fail-slow and fail-stop devices."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from api.tasks.telemetry_body import parse_detect_body
from cost_models.efficiency import EfficiencyParams, SoftwareConfig
from cost_models.gpu_efficiency import builtin_efficiency
from cost_models.hardware import gpu_preset, gpu_preset_names
from cost_models.model_spec import ModelSpec
from detector import DetectionLayout, ItemTotals, TelemetryError, detect, layout_from_plan
from planner.errors import PlanningError
from wire.convert import resolve_model
from wire.detection import DetectResponse, FailSlowDevice, RoleTimeModel
from wire.schemas import Plan


@dataclass(frozen=True)
class PlanNeeded:
    """`detect_json`'s answer when it was not given the stored plan the request names: fetch that one."""

    plan_id: str


def detect_json(body: bytes, stored_plan_json: str | None) -> DetectResponse | PlanNeeded:
    """Parse, validate and run a /v1/detect body against `stored_plan_json` (the stored Plan's JSON text).

    Runs in a solver worker: 4,096 devices x 8 iterations of telemetry is 25-60 MB of JSON, seconds of
    parsing that must not hold the server's event loop. The body is reduced item by item
    (api.tasks.telemetry_body), so the worker's memory stays a small multiple of the body. BodyValidationError
    when the body is not a valid DetectRequest.
    """
    parsed = parse_detect_body(body)
    if stored_plan_json is None:
        return PlanNeeded(parsed.plan_id)
    plan = Plan.model_validate_json(stored_plan_json)
    if plan.plan_id != parsed.plan_id:
        return PlanNeeded(parsed.plan_id)
    return detect_for(plan, parsed.telemetry)


def detect_for(plan: Plan, telemetry: Iterable[ItemTotals]) -> DetectResponse:
    """Fail-slow and fail-stop devices of `plan` in `telemetry` (TelemetryItems or their totals)."""
    if plan.architecture is not None:
        model = resolve_model(plan.architecture)
    elif plan.model:
        model = resolve_model(plan.model)
    else:
        raise PlanningError(f"plan {plan.plan_id} records no model architecture to normalize compute times with")
    layout = plan_layout(plan, model)
    try:
        result = detect(telemetry, layout)
    except TelemetryError as error:
        raise PlanningError(f"plan {plan.plan_id}: {error}") from None
    return DetectResponse(
        fail_slow=[FailSlowDevice(device=f.device, speed=f.speed, confidence=f.confidence) for f in result.fail_slow],
        fail_stop=list(result.fail_stop),
        time_models=[
            RoleTimeModel(layers=list(role.layers), tp=role.tp, devices=len(role.devices),
                          alpha_ms_per_token=_significant(fit.alpha_ms_per_token),
                          beta_ms_per_token_squared=_significant(fit.beta_ms_per_token_squared),
                          attention_factor=round(fit.attention_factor, 3), source=fit.source)
            for role, fit in zip(layout.roles, result.time_models, strict=True)
        ],
    )


def plan_pricing(plan: Plan) -> tuple[EfficiencyParams | None, SoftwareConfig]:
    """The efficiency parameters and attention kernel the detector's work prior prices `plan` with, as far as the
    plan records them: a preset GPU's built-in parameters (GET /v1/gpus; Hopper's fitted attention fraction on GPUs
    with FP8 tensor cores), else (a custom GPU, or a plan stored before it recorded its GPU) the A100 fit; its
    attention kernel (fused for older plans). A calibration the plan was priced with is not read: the prior only
    seeds what the detector fits from the telemetry."""
    efficiency = builtin_efficiency(gpu_preset(plan.gpu)) if plan.gpu in gpu_preset_names() else None
    return efficiency, SoftwareConfig(attention_kernel=plan.attention_kernel or "fused")


def plan_layout(plan: Plan, model: ModelSpec) -> DetectionLayout:
    """The detector's roles of `plan`, their work prior priced as the plan was (`plan_pricing`)."""
    efficiency, software = plan_pricing(plan)
    return layout_from_plan(plan, model, efficiency=efficiency, software=software)


def _significant(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.4g}")
