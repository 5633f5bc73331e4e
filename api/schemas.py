"""Wire models of API.md v1. Field names here are the public contract.

These models import only pydantic, so the CLI and adapter clients use them
without FastAPI.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEVICE_PATTERN = re.compile(r"^(\d+):(\d+|\*)$")

MAX_NODES = 16_384
MAX_GPUS_PER_NODE = 72
MAX_LIST_LENGTH = 131_072
MAX_CLUSTER_GPUS = 131_072  # num_nodes x gpus_per_node
MAX_DEVICE_ID_CHARS = 24  # "16383:71" is 8; longer ids are typos or abuse (int() of huge digit strings fails)
MAX_TOKENS_PER_ITERATION = 2**31  # global_batch_size x seq_length; ~100x the largest published batches
# The largest published batch in sequences is BERT-with-LAMB's 65,536. Every microbatch is an op of every
# stage's timeline: 65,536 on one 8-GPU node already take ~8 s to simulate and answer 30 MB.
MAX_GLOBAL_BATCH_SEQUENCES = 65_536
MIN_PEAK_TFLOPS = 0.1
MIN_MEMORY_GIB = 0.1
MIN_BANDWIDTH_GB_S = 0.01
MIN_SPEED = 0.001  # the least speed the detector reports, so its estimates can be replanned with


class _Strict(BaseModel):
    """Unknown fields are rejected so a typo is an error, not a silent default."""

    model_config = ConfigDict(extra="forbid")


class GpuObject(_Strict):
    name: str = Field(min_length=1, max_length=64)
    # Lower bounds keep every derived time finite: near-zero rates make times overflow to inf (a 500, or
    # NaN in the answer). Each is far below any accelerator a training job runs on.
    peak_tflops: float = Field(ge=MIN_PEAK_TFLOPS, le=100_000, description="Dense bf16 TFLOP/s per GPU.")
    memory_gib: float = Field(ge=MIN_MEMORY_GIB, le=4096, description="HBM capacity per GPU, GiB.")
    hbm_bandwidth_gb_s: float | None = Field(
        default=None, ge=MIN_BANDWIDTH_GB_S, le=100_000,
        description="HBM bandwidth GB/s; default scales A100's by peak FLOP/s.",
    )


class Cluster(_Strict):
    num_nodes: int = Field(ge=1, le=MAX_NODES)
    gpus_per_node: int = Field(ge=1, le=MAX_GPUS_PER_NODE)
    gpu: str | GpuObject = Field(description="A preset name (A100-40GB, A100-80GB, H100-SXM, H200, B200) or an object.")
    intra_node_bandwidth_gb_s: float | None = Field(
        default=None, ge=MIN_BANDWIDTH_GB_S, le=100_000,
        description="Unidirectional NVLink GB/s per GPU; default from the GPU preset.",
    )
    inter_node_bandwidth_gb_s: float | None = Field(
        default=None, ge=MIN_BANDWIDTH_GB_S, le=100_000,
        description="Unidirectional network GB/s per GPU; default from the GPU preset.",
    )

    @model_validator(mode="after")
    def _size(self) -> Cluster:
        gpus = self.num_nodes * self.gpus_per_node
        if gpus > MAX_CLUSTER_GPUS:
            raise ValueError(
                f"the cluster has {self.num_nodes:,} nodes x {self.gpus_per_node} GPUs = {gpus:,} GPUs; "
                f"at most {MAX_CLUSTER_GPUS:,} are supported"
            )
        return self


class SlowDevice(_Strict):
    device: str = Field(max_length=MAX_DEVICE_ID_CHARS, description='"<node>:<gpu>"')
    speed: float = Field(
        ge=MIN_SPEED, le=1,
        description=f"Fraction of healthy speed still delivered, in [{MIN_SPEED}, 1]; list a slower GPU as failed.",
    )

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str) -> str:
        match = DEVICE_PATTERN.match(value)
        if not match or match.group(2) == "*":
            raise ValueError(f'slow device {value!r} must look like "<node>:<gpu>", e.g. "9:2"')
        return value


class Failures(_Strict):
    failed: list[Annotated[str, Field(max_length=MAX_DEVICE_ID_CHARS)]] = Field(
        default_factory=list, max_length=MAX_LIST_LENGTH
    )
    slow: list[SlowDevice] = Field(default_factory=list, max_length=MAX_LIST_LENGTH)

    @field_validator("failed")
    @classmethod
    def _failed_form(cls, values: list[str]) -> list[str]:
        for value in values:
            if not DEVICE_PATTERN.match(value):
                raise ValueError(f'failed device {value!r} must look like "<node>:<gpu>" or "<node>:*", e.g. "3:5"')
        return values


class ModelArchitecture(_Strict):
    num_layers: int = Field(ge=1, le=1024)
    hidden_size: int = Field(ge=1, le=262_144)
    ffn_hidden_size: int = Field(ge=1, le=1_048_576)
    num_attention_heads: int = Field(ge=1, le=4096)
    num_kv_heads: int | None = Field(default=None, ge=1, le=4096, description="Defaults to num_attention_heads.")
    vocab_size: int = Field(ge=1, le=4_194_304)
    swiglu: bool = True
    tied_embeddings: bool = False
    name: str = Field(default="custom", max_length=128)

    @model_validator(mode="after")
    def _shape(self) -> ModelArchitecture:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        kv = self.num_kv_heads or self.num_attention_heads
        if self.num_attention_heads % kv:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_kv_heads {kv}")
        return self


class HfConfigModel(_Strict):
    hf_config: dict[str, Any] = Field(description="A Hugging Face config.json, as-is.")


Recompute = Literal["none", "selective", "full", "auto"]
Schedule = Literal["1f1b", "interleaved"]
ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "optimized"]


class Training(_Strict):
    global_batch_size: int = Field(ge=1, le=MAX_GLOBAL_BATCH_SEQUENCES, description="Sequences per iteration.")
    seq_length: int = Field(ge=1, le=1_048_576, description="Tokens per sequence.")
    micro_batch_size: int | None = Field(default=None, ge=1, le=4096, description="null: the planner chooses.")
    precision: Literal["bf16", "fp16"] = "bf16"
    zero_stage: Literal[0, 1] = 1
    recompute: Recompute = "auto"

    @model_validator(mode="after")
    def _tokens(self) -> Training:
        tokens = self.global_batch_size * self.seq_length
        if tokens > MAX_TOKENS_PER_ITERATION:
            raise ValueError(
                f"global_batch_size {self.global_batch_size:,} x seq_length {self.seq_length:,} = {tokens:,} tokens "
                f"per iteration; at most {MAX_TOKENS_PER_ITERATION:,} are supported"
            )
        return self


class Options(_Strict):
    time_limit_s: float = Field(default=10.0, gt=0, le=3600, description="Solver wall-time budget, seconds.")
    allow_non_uniform: bool = True
    random_seed: int = Field(default=0, ge=0, le=2**31 - 1, description="CP-SAT seed; fixed for reproducible plans.")
    amortize_iterations: int = Field(
        default=500, ge=1, le=10_000_000,
        description="Replanning only: iterations a new layout is expected to run; its migration time is divided "
        "by this and added to the iteration time when choosing between moving and staying.",
    )
    schedules: list[ScheduleName] | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        description="Pipeline schedules the plan may use. Default: all, or gpipe/1f1b/interleaved (what stock "
        "Megatron-LM and DeepSpeed run) when allow_non_uniform is false. `optimized` is resiplan's CP-SAT schedule.",
    )


ModelField = Annotated[
    str | ModelArchitecture | HfConfigModel,
    Field(description="A preset name, an architecture object, or {\"hf_config\": {...}}."),
]


class PlanRequest(_Strict):
    cluster: Cluster
    failures: Failures = Field(default_factory=Failures)
    model: ModelField
    training: Training
    options: Options = Field(default_factory=Options)


class Layout(_Strict):
    tp: int = Field(ge=1, le=MAX_GPUS_PER_NODE)
    pp: int = Field(ge=1, le=1024)
    micro_batch_size: int = Field(default=1, ge=1, le=4096)
    virtual_stages: int = Field(default=1, ge=1, le=64)
    schedule: Schedule = "1f1b"
    recompute: Literal["none", "selective", "full"] = "selective"
    layers_per_stage: list[int] | None = Field(default=None, max_length=1024)
    dp: int | None = Field(default=None, ge=1, description="Replicas; default as many as the healthy devices allow.")


class EstimateRequest(PlanRequest):
    layout: Layout


class Stage(BaseModel):
    id: int
    layers: tuple[int, int] = Field(description="Half-open [first, last) transformer layers.")
    devices: list[str]
    tp: int
    memory_gib: float
    forward_ms: float
    backward_ms: float
    speed: float = Field(default=1.0, description="Slowest member's speed.")
    weight_grad_ms: float = Field(
        default=0.0, description="Part of backward_ms computing weight gradients (W in zero-bubble schedules)."
    )
    activation_gib: float = Field(default=0.0, description="Activations one in-flight microbatch keeps on the stage.")
    static_memory_gib: float = Field(
        default=0.0, description="Weights, gradients, optimizer state and reserved memory: memory_gib minus activations."
    )


class Replica(BaseModel):
    id: int
    num_microbatches: int
    stages: list[Stage]


class Breakdown(BaseModel):
    compute_s: float
    pipeline_bubble_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float = 0.0
    optimizer_s: float = 0.0


class Predicted(BaseModel):
    iteration_time_s: float
    tokens_per_s: float
    mfu: float
    breakdown: Breakdown


class SolverReport(BaseModel):
    status: str
    wall_time_s: float
    gap: float
    objective_ms: float | None = None
    bound_ms: float | None = None
    candidates_total: int | None = None
    candidates_solved: int | None = None


class ReplanCandidate(BaseModel):
    """One layout the replan weighed: `replan` (the new optimum on the devices that hold most of its
    state), `scratch` (the same optimum placed ignoring the running layout; for comparison, never
    chosen) or `keep` (the running layout, when all its devices are alive; its iteration time is then
    an upper bound when a device it uses got slower or faster)."""

    name: Literal["replan", "scratch", "keep"]
    iteration_time_s: float
    bytes_moved: int
    migration_s: float
    objective_ms: float = Field(description="iteration_time_s plus migration_s / amortize_iterations, in ms.")


class Migration(BaseModel):
    bytes_moved: int = Field(description="Weights and optimizer state the devices of the new plan receive.")
    devices_changed: list[str] = Field(description="Alive devices whose state changes: receive, shed or leave.")
    estimated_s: float = Field(description="Transfer time of the slowest receiving device over the cluster's links.")
    bytes_from_checkpoint: int = Field(
        default=0, description="State only failed devices held (e.g. their ZeRO-1 optimizer shards): it must be "
        "read from the last checkpoint.")
    amortize_iterations: int | None = None
    chosen: str | None = Field(default=None, description="The candidate this plan is.")
    candidates: list[ReplanCandidate] = Field(default_factory=list)


class StageTimeline(BaseModel):
    """One stage's operations in the order it runs them, with simulated times."""

    stage: int
    ops: list[str] = Field(description="`F3` forward of microbatch 3, `B3` full backward, `I3`/`W3` input/weight "
                                       "gradient halves; `F3.1` is model chunk 1 of an interleaved stage.")
    start_ms: list[float]
    end_ms: list[float]
    busy_ms: float
    peak_activation_gib: float


class ReplicaSchedule(BaseModel):
    """The timeline of one replica; replicas with the same stages and microbatches share it."""

    replica_ids: list[int]
    schedule: str
    makespan_ms: float
    bubble_fraction: float
    stages: list[StageTimeline]


class PipelineSchedule(BaseModel):
    """What each stage runs, in order: the part of the plan trainers execute."""

    name: str = Field(description="Schedule of the slowest replica: gpipe, 1f1b, interleaved, zb-h1, zb-h2 or optimized.")
    bubble_fraction: float = Field(description="Idle share of the slowest replica's busiest stage.")
    candidates_ms: dict[str, float] = Field(
        default_factory=dict, description="Makespan of every schedule tried for the slowest replica."
    )
    replicas: list[ReplicaSchedule]


class Plan(BaseModel):
    plan_id: str
    status: str
    uniform: bool
    micro_batch_size: int
    schedule: str
    virtual_stages: int
    recompute: str
    zero_stage: int
    replicas: list[Replica]
    unused_devices: list[str]
    excluded_devices: list[str]
    predicted: Predicted
    solver: SolverReport
    model: str | None = None
    parent_plan_id: str | None = None
    migration: Migration | None = None
    pipeline_schedule: PipelineSchedule | None = None
    slow_devices: list[SlowDevice] = Field(
        default_factory=list, description="The request's slow GPUs that are not failed, for maps and replanning."
    )
    architecture: ModelArchitecture | None = Field(default=None, description="The model's shape, for trainer configs.")
    global_batch_size: int | None = None
    seq_length: int | None = None
    precision: str | None = None


class ErrorDetail(BaseModel):
    detail: str | list[Any]


# POST /v1/detect -------------------------------------------------------------

MAX_TELEMETRY_ITEMS = 131_072  # e.g. 4,096 devices x 32 iterations, or 16,384 x 8
MAX_MICROBATCHES_PER_ITEM = 4_096
MAX_SEQUENCES_PER_MICROBATCH = 65_536


class TelemetryMicrobatch(_Strict):
    seq_lengths: list[Annotated[int, Field(ge=1, le=1_048_576)]] = Field(
        min_length=1, max_length=MAX_SEQUENCES_PER_MICROBATCH, description="Tokens of every sequence packed in it."
    )
    compute_ms: float = Field(ge=0, allow_inf_nan=False, description="The device's compute time for it, ms.")


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
        match = DEVICE_PATTERN.match(value)
        if not match or match.group(2) == "*":
            raise ValueError(f'telemetry device {value!r} must look like "<node>:<gpu>", e.g. "3:5"')
        return value


class ReplanRequest(_Strict):
    """The complete failure state now; options not given are the parent request's."""

    failures: Failures = Field(default_factory=Failures)
    options: Options | None = Field(
        default=None, description="Only the fields given change the parent request's options, e.g. "
        "{\"time_limit_s\": 5, \"amortize_iterations\": 1000}.")


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


class DetectResponse(BaseModel):
    fail_slow: list[FailSlowDevice]
    fail_stop: list[str]
