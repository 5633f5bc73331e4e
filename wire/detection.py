"""`/v1/detect`'s request and answer: a window of per-device telemetry in, fail-slow and fail-stop devices out."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, field_validator

from wire.schemas import MAX_DEVICE_ID_CHARS, _checked_device, _Strict

MAX_TELEMETRY_ITEMS = 131_072  # e.g. 4,096 devices x 32 iterations, or 16,384 x 8
MAX_MICROBATCHES_PER_ITEM = 4_096
MAX_SEQUENCES_PER_MICROBATCH = 65_536
MAX_COMPUTE_MS = 1e9  # ms a microbatch: 11.6 days


class TelemetryMicrobatch(_Strict):
    seq_lengths: list[Annotated[int, Field(ge=1, le=1_048_576)]] = Field(
        min_length=1, max_length=MAX_SEQUENCES_PER_MICROBATCH, description="Tokens of every sequence packed in it."
    )
    # A microbatch over 11 days is not a measurement; the bound keeps every sum and square the fit takes finite.
    compute_ms: float = Field(ge=0, le=MAX_COMPUTE_MS, allow_inf_nan=False,
                              description="The device's compute time for it, ms (at most 1e9).")


class DeviceTelemetry(_Strict):
    device: str = Field(max_length=MAX_DEVICE_ID_CHARS, description='"<node>:<gpu>", a device of the plan\'s stages')
    iteration: int = Field(ge=0, le=2**62)
    microbatches: list[TelemetryMicrobatch] = Field(
        max_length=MAX_MICROBATCHES_PER_ITEM, description="May be empty for a device that ran nothing."
    )
    last_heartbeat_s_ago: float = Field(ge=0, allow_inf_nan=False)

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str) -> str:
        return _checked_device(value, "telemetry")


class DetectRequest(_Strict):
    plan_id: str = Field(min_length=1, max_length=64)
    telemetry: list[DeviceTelemetry] = Field(
        min_length=1,
        max_length=MAX_TELEMETRY_ITEMS,
        description="The last iterations (8 recommended, at least 3) of every device, one item per device and iteration.",
    )


class FailSlowDevice(BaseModel):
    device: str
    speed: float = Field(description="Estimated fraction of healthy speed, (0, 1].")
    confidence: float = Field(description="0..1; 0.5 at the minimum evidence (3 iterations just over the threshold).")


class RoleTimeModel(BaseModel):
    """A role's compute time per microbatch measured from the window: alpha x tokens + beta x sum of squared
    sequence lengths (added to API.md's answer)."""

    layers: list[int] = Field(description="[first, end) of the stages doing this work")
    tp: int
    devices: int = Field(description="How many devices do this work (stages across replicas).")
    alpha_ms_per_token: float | None = Field(description="None when no device of the role reported work.")
    beta_ms_per_token_squared: float | None
    attention_factor: float = Field(description="Measured attention-to-linear cost over the cost model's.")
    source: str = Field(description="`role`: fitted on this role's telemetry, which rejects k x 1.5 and k / 1.5 at 99%; "
                        "`job`: the job's attention factor (this role's window does not pin its own: packs that vary "
                        "too little, too few samples, a single device, or two devices over a short window); `prior`: "
                        "the cost model's (the job's window does not pin one either).")


class DetectResponse(BaseModel):
    fail_slow: list[FailSlowDevice]
    fail_stop: list[str]
    time_models: list[RoleTimeModel] = Field(default_factory=list)
