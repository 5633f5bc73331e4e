"""Fail-slow and fail-stop detection from per-device training telemetry (POST /v1/detect).

Pure logic: frozen dataclasses in, frozen dataclasses out; imports `cost_models` only. See `detector` for
the rules and thresholds, `work` for the work model.
"""

from detector.detector import (
    CONSECUTIVE_ITERATIONS,
    HEARTBEAT_TIMEOUT_S,
    MIN_BASELINE_ITERATIONS,
    MIN_ROLE_PEERS,
    RECOMMENDED_WINDOW,
    SLOW_THRESHOLD,
    SPEED_WINDOW,
    Detection,
    DetectorOptions,
    DeviceIteration,
    FailSlow,
    decide,
    detect,
    summarize,
)
from detector.fit import RoleFit, fit_roles
from detector.telemetry import (
    ItemTotals,
    Microbatch,
    TelemetryError,
    TelemetryItem,
    TelemetryTotals,
)
from detector.work import (
    DetectionLayout,
    Role,
    WorkModel,
    layout_from_plan,
    layout_from_stages,
    role_work_model,
)

__all__ = [
    "CONSECUTIVE_ITERATIONS",
    "HEARTBEAT_TIMEOUT_S",
    "MIN_BASELINE_ITERATIONS",
    "MIN_ROLE_PEERS",
    "RECOMMENDED_WINDOW",
    "SLOW_THRESHOLD",
    "SPEED_WINDOW",
    "Detection",
    "DetectionLayout",
    "DetectorOptions",
    "DeviceIteration",
    "FailSlow",
    "ItemTotals",
    "Microbatch",
    "Role",
    "RoleFit",
    "TelemetryError",
    "TelemetryItem",
    "TelemetryTotals",
    "WorkModel",
    "decide",
    "detect",
    "fit_roles",
    "layout_from_plan",
    "layout_from_stages",
    "role_work_model",
    "summarize",
]
