"""The planner's answer as frozen dataclasses; field names match API.md's Plan."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageResult:
    id: int
    layers: tuple[int, int]
    devices: tuple[str, ...]
    tp: int
    memory_gib: float
    forward_ms: float
    backward_ms: float
    speed: float


@dataclass(frozen=True)
class ReplicaResult:
    id: int
    num_microbatches: int
    stages: tuple[StageResult, ...]


@dataclass(frozen=True)
class PredictedResult:
    iteration_time_s: float
    tokens_per_s: float
    mfu: float
    breakdown: dict[str, float]


@dataclass(frozen=True)
class SolverResult:
    status: str
    wall_time_s: float
    gap: float
    objective_ms: float
    bound_ms: float
    candidates_total: int
    candidates_solved: int


@dataclass(frozen=True)
class PlanResult:
    status: str
    uniform: bool
    micro_batch_size: int
    schedule: str
    virtual_stages: int
    recompute: str
    zero_stage: int
    replicas: tuple[ReplicaResult, ...]
    unused_devices: tuple[str, ...]
    excluded_devices: tuple[str, ...]
    predicted: PredictedResult
    solver: SolverResult
    model: str
