"""The planner's answer as frozen dataclasses; field names match API.md's Plan."""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.hardware import GIB
from cost_models.iteration import StageTime
from cost_models.model_spec import ModelSpec
from planner.schedules.ops import ChunkShare, GradSync
from planner.schedules.result import ScheduleChoice


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
    weight_grad_ms: float = 0.0
    activation_gib: float = 0.0
    static_memory_gib: float = 0.0
    cp: int = 1  # context-parallel ranks: devices holds tp x cp GPUs, tp fastest
    grad_sync: GradSync | None = None  # internal: what schedules that hide the sync differently need
    chunk_layers: tuple[int, ...] | None = None  # layers of each model chunk when they are uneven; None: even
    chunk_shares: tuple[ChunkShare, ...] | None = None  # internal: each chunk's share of the stage's work


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
    calibration_id: str | None = None  # the stored calibration that priced the plan


@dataclass(frozen=True)
class SolverResult:
    status: str
    wall_time_s: float
    gap: float
    objective_ms: float
    bound_ms: float
    candidates_total: int
    candidates_solved: int
    # The limit the answer was computed under, when it differs from the request's, and why.
    time_limit_s: float | None = None
    notes: tuple[str, ...] = ()
    stopped_by: str | None = None  # which limit ended the search (planner.plan.stopped_by); None: no search


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
    pipeline_schedule: ScheduleChoice | None = None
    slow_devices: tuple[tuple[str, float], ...] = ()  # (device, speed) of every slow, not failed, GPU
    # What trainers need beyond the layout to configure a run of this plan.
    architecture: ModelSpec | None = None
    global_batch_size: int | None = None
    seq_length: int | None = None
    precision: str | None = None
    gpu_memory_gib: float | None = None  # one GPU's capacity
    gpu: str | None = None  # the GPU's name (a preset's, or a custom GPU's own)
    attention_kernel: str | None = None  # "fused" or "fa2": the attention kernels priced
    memory_reserve_gib: float | None = None  # left free per GPU: every stage's memory_gib fits capacity less this
    ep: int = 1  # expert parallelism: each stage's routed experts split over ep GPUs (`ParallelShape.expert_span`)
    dp_shard: int | None = None  # replicas of a ZeRO shard group, consecutive; None: not one size (non-uniform)
    grad_precision: str | None = None  # "fp32" or "bf16": what gradients accumulate and reduce in; None with fp16
    optimizer_precision: str = "fp32"  # "bf16": no fp32 master weights (`SoftwareConfig.master_weights`)
    moe_dispatcher: str | None = None  # "alltoall" or "flex": the token dispatcher priced; None for dense models
    etp: int | None = None  # expert tensor parallelism: each routed expert split over etp GPUs; None: tp
    moe_a2a_overlap: bool = False  # the all-to-alls priced under Megatron's batch-level EP overlap
    tp_comm_overlap: str = "none"  # "megatron" or "async_tp": how TP collectives are priced (`tp_overlap_name`)


def stage_schedule_fields(timing: StageTime) -> dict[str, float]:
    """What schedules need of a stage beyond forward and backward: W's share and memory parts."""
    return {
        "weight_grad_ms": round(timing.weight_grad_ms, 3),
        "activation_gib": round(timing.activation_bytes_per_microbatch / GIB, 4),
        "static_memory_gib": round(timing.static_memory_bytes / GIB, 4),
    }
