"""Wire models of API.md v1. Field names here are the public contract.

These models import only pydantic and cost_models (the device-id grammar, and model_spec, which checks a
Hugging Face config against the same architecture limits), so the CLI and
adapter clients use them without FastAPI.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from cost_models.device import MAX_DEVICE_ID_CHARS, Device, DeviceIdError, DeviceSpec
from wire.gpu_object import MIN_BANDWIDTH_GB_S, GpuObject
from wire.migration import Migration, ReplanCandidate  # noqa: F401  (re-exported: part of the Plan)
from wire.model_schemas import HfConfigModel, ModelArchitecture, RopeScalingModel  # noqa: F401  (re-exported)
from wire.strict import _Strict

MAX_NODES = 16_384
MAX_GPUS_PER_NODE = 72
MAX_LIST_LENGTH = 131_072
MAX_CLUSTER_GPUS = 131_072  # num_nodes x gpus_per_node
MAX_TOKENS_PER_ITERATION = 2**31  # global_batch_size x seq_length; ~100x the largest published batches
# The largest published batch in sequences is BERT-with-LAMB's 65,536. Every microbatch is an op of every
# stage's timeline: 65,536 on one 8-GPU node already take ~8 s to simulate and answer 30 MB.
MAX_GLOBAL_BATCH_SEQUENCES = 65_536
MIN_SPEED = 0.001  # the least speed the detector reports, so its estimates can be replanned with
# Tags of the members of "a preset name or an object" fields; wire.errors leaves `<...>` parts out of field paths.
PRESET_TAG, OBJECT_TAG, ARCHITECTURE_TAG, HF_CONFIG_TAG = "<preset>", "<object>", "<architecture>", "<hf_config>"


def _checked_device(value: str, role: str) -> str:
    """`value` if it is one GPU's id (cost_models.device grammar); the error names the role it was given in."""
    try:
        Device.parse(value)
    except DeviceIdError as error:
        raise ValueError(f"{role} {error}") from None
    return value


def _member_kind(value: Any, object_kinds: dict[str, str], default_object_kind: str) -> str | None:
    """Which member of a "name or object" union `value` is meant as: the tag of its form, so a bad object
    is reported against the one model it was meant as, not against every member of the union."""
    if isinstance(value, str):
        return PRESET_TAG
    if isinstance(value, dict):
        return next((tag for key, tag in object_kinds.items() if key in value), default_object_kind)
    if isinstance(value, BaseModel):
        return next((tag for tag, model in _TAGGED_MODELS.items() if isinstance(value, model)), None)
    return None


class Cluster(_Strict):
    num_nodes: int = Field(ge=1, le=MAX_NODES)
    gpus_per_node: int = Field(ge=1, le=MAX_GPUS_PER_NODE)
    gpu: Annotated[
        Annotated[str, Tag(PRESET_TAG)] | Annotated[GpuObject, Tag(OBJECT_TAG)],
        Discriminator(
            lambda value: _member_kind(value, {}, OBJECT_TAG),
            custom_error_type="gpu_kind",
            custom_error_message='must be a preset name or an object {"name", "peak_tflops", "memory_gib"}',
        ),
    ] = Field(description="A preset name (A100-40GB, A100-80GB, H100-SXM, H200, B200) or an object.")
    intra_node_bandwidth_gb_s: float | None = Field(
        default=None, ge=MIN_BANDWIDTH_GB_S, le=100_000,
        description="Unidirectional NVLink GB/s per GPU; default from the GPU preset.",
    )
    inter_node_bandwidth_gb_s: float | None = Field(
        default=None, ge=MIN_BANDWIDTH_GB_S, le=100_000,
        description="Unidirectional network GB/s per GPU; default from the GPU preset.",
    )
    nvlink_topology: Literal["switch", "mesh"] = Field(default="switch", description='"switch": NVSwitch; "mesh": GPUs '
        'linked directly (4-GPU HGX boards, NVLink bridges), a group of g of n GPUs at (g-1)/(n-1) of the bandwidth.')

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
        return _checked_device(value, "slow")


class Failures(_Strict):
    failed: list[Annotated[str, Field(max_length=MAX_DEVICE_ID_CHARS)]] = Field(
        default_factory=list, max_length=MAX_LIST_LENGTH
    )
    slow: list[SlowDevice] = Field(default_factory=list, max_length=MAX_LIST_LENGTH)

    @field_validator("failed")
    @classmethod
    def _failed_form(cls, values: list[str]) -> list[str]:
        for value in values:
            try:
                DeviceSpec.parse(value)
            except DeviceIdError as error:
                raise ValueError(f"failed {error}") from None
        return values


Recompute = Literal["none", "selective", "full", "auto"]
# What an estimate can price without a search: every handcrafted schedule (`optimized` is a CP-SAT search).
EstimateSchedule = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "looped-bfs"]
ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "looped-bfs", "optimized"]


class Training(_Strict):
    global_batch_size: int = Field(ge=1, le=MAX_GLOBAL_BATCH_SEQUENCES, description="Sequences per iteration.")
    seq_length: int = Field(ge=1, le=1_048_576, description="Tokens per sequence.")
    micro_batch_size: int | None = Field(default=None, ge=1, le=4096, description="null: the planner chooses.")
    precision: Literal["bf16", "fp16", "fp8"] = Field(
        default="bf16",
        description="fp8: the layers' linear projections in FP8 (Transformer Engine, hybrid E4M3/E5M2), "
                    "the rest in bf16; needs a GPU with FP8 tensor cores.",
    )
    zero_stage: Literal[0, 1, 2, 3, "auto"] = Field(
        default=1,
        description="Data-parallel sharding: 0 none, 1 optimizer state (Megatron's distributed optimizer), 2 also "
                    "gradients (reduce-scattered every microbatch), 3 also weights (FSDP / ZeRO-3: gathered layer by "
                    "layer in forward and backward); auto: the planner plans 1, 2 and 3 and keeps the fastest (not "
                    "for estimates). Stages 2 and 3 are planned on stock layouts.",
    )
    recompute: Recompute = "auto"
    grad_precision: Literal["fp32", "bf16"] | None = Field(
        default=None,
        description="The dtype gradients accumulate and are reduced in, with bf16 or fp8 training: fp32 (the "
                    "default, Megatron-LM's: 4 bytes a parameter) or bf16 (Megatron-LM's --grad-reduce-in-bf16, "
                    "NVIDIA's performance recipes: 2 bytes, half the data-parallel traffic). fp16 training keeps "
                    "its own (fp32 accumulation, fp16 reduction).",
    )
    optimizer_precision: Literal["fp32", "bf16"] = Field(default="fp32", description="fp32: fp32 master weights and "
        "Adam moments (12 bytes a parameter); bf16: the model itself trains in bf16, moments too (4 bytes).")
    moe_dispatcher: Literal["alltoall", "flex"] = Field(
        default="alltoall",
        description="How a mixture of experts' tokens reach their experts across expert-parallel ranks: alltoall "
                    "(Megatron's all-to-all dispatcher: one copy per routed expert) or flex (Megatron's flex "
                    "dispatcher over DeepEP or HybridEP: one network copy per remote node, forwarded over NVLink).",
    )
    moe_a2a_overlap: bool = Field(
        default=False,
        description="Let Megatron's batch-level expert-parallel overlap (--overlap-moe-expert-parallel-comm) hide "
                    "a mixture of experts' all-to-alls: the forward of one microbatch and the backward of another "
                    "run as one step, each all-to-all under the block of the other's computation run beside it. "
                    "Priced, and exported, for the layouts megatron-core runs it on (ep > 1, no full recompute, one "
                    "pipeline stage or an interleaved pipeline); other layouts pay their all-to-alls exposed. "
                    "Plans say whether theirs uses it (moe_a2a_overlap).",
    )
    tp_comm_overlap: Literal["none", "megatron", "async_tp"] = Field(
        default="none",
        description="How the trainer overlaps tensor-parallel collectives with the GEMMs that produce or consume "
                    "them: none; megatron (Megatron-LM's --tp-comm-overlap, Transformer Engine's userbuffers: the "
                    "forward's and the backward's collectives hide behind their GEMMs but one chunk each); or "
                    "async_tp (PyTorch's asynchronous TP, torchtitan's --compile.enable_async_tensor_parallel: the "
                    "forward's only, the backward's stay exposed). Matters with tp > 1; plans say which they priced "
                    "(tp_comm_overlap) and the exports ask their trainer for it.",
    )
    attention_kernel: Literal["fused", "fa2"] = Field(
        default="fused",
        description="The attention kernels the trainer runs: fused (Transformer Engine's cuDNN attention, as "
                    "Megatron-LM runs it, or FlashAttention-3; FlashAttention-2 on Ampere GPUs, where it is the "
                    "fused kernel) or fa2 (FlashAttention-2 on a Hopper or newer GPU: flash-attn 2, or PyTorch "
                    "SDPA's flash backend, which torchtitan uses), priced 1.6x the fused kernels' attention time "
                    "from the FlashAttention-3 paper's H100 measurements. Matters at long sequences, where "
                    "attention dominates.",
    )

    @model_validator(mode="after")
    def _grad_precision(self) -> Training:
        if self.grad_precision == "bf16" and self.precision == "fp16":
            raise ValueError("grad_precision bf16 with precision fp16: fp16 training accumulates its gradients in "
                             "fp32 and reduces them in fp16; use precision bf16 for bf16 gradients")
        return self

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
    calibration_id: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{32}$",
        description="Price with the efficiency parameters of a stored calibration (POST /v1/calibrations) "
        "instead of the built-in ones; the plan names it in predicted.calibration_id.")
    memory_reserve_gib: float | None = Field(
        default=None, ge=0, le=1024,
        description="GiB per GPU a plan leaves free for what the cost model does not count: CUDA context, NCCL "
        "buffers, allocator fragmentation. Default 3 (README, \"Memory reserve\"); raise it to ~5 with NVLink SHARP on.")
    random_seed: int = Field(default=0, ge=0, le=2**31 - 1, description="CP-SAT seed; fixed for reproducible plans.")
    max_context_parallel: int | None = Field(
        default=None, ge=1, le=1024,
        description="Most context-parallel ranks per stage the search may use (1: none, for trainers without "
        "context parallelism). Default: 32 for sequences of 16,384 tokens or more, else 1. CP is searched only "
        "with flash attention, for sizes that cut seq_length into 2 cp chunks each split over tp.")
    max_expert_parallel: int | None = Field(
        default=None, ge=1, le=4096,
        description="Mixture-of-experts models: the most replicas the search may split the routed experts over "
        "(1: no expert parallelism, for trainers without it). Default: no limit beyond the experts and replicas.")
    allow_hybrid_sharding: bool = Field(
        default=True,
        description="Whether ZeRO-2/3 plans may shard their state over a node's replicas and replicate it across "
        "nodes (hybrid sharding, HSDP: `dp_shard` below the replica count), which keeps their per-layer collectives "
        "on NVLink. false for trainers without it (DeepSpeed 0.19 removed MiCS).")
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
        "Megatron-LM and DeepSpeed run) when allow_non_uniform is false. `optimized` is resiplan's CP-SAT schedule; "
        "`looped-bfs` is breadth-first pipelining (PyTorch's ScheduleLoopedBFS) over virtual stages.",
    )


_TAGGED_MODELS: dict[str, type[BaseModel]] = {
    OBJECT_TAG: GpuObject, ARCHITECTURE_TAG: ModelArchitecture, HF_CONFIG_TAG: HfConfigModel,
}

ModelField = Annotated[
    Annotated[str, Tag(PRESET_TAG)]
    | Annotated[ModelArchitecture, Tag(ARCHITECTURE_TAG)]
    | Annotated[HfConfigModel, Tag(HF_CONFIG_TAG)],
    Discriminator(
        lambda value: _member_kind(value, {"hf_config": HF_CONFIG_TAG}, ARCHITECTURE_TAG),
        custom_error_type="model_kind",
        custom_error_message='must be a preset name, an architecture object or {"hf_config": {...}}',
    ),
    Field(description="A preset name, an architecture object, or {\"hf_config\": {...}}."),
]


class PlanRequest(_Strict):
    cluster: Cluster
    failures: Failures = Field(default_factory=Failures)
    model: ModelField
    training: Training
    options: Options = Field(default_factory=Options)


class LayoutStage(_Strict):
    devices: list[Annotated[str, Field(max_length=MAX_DEVICE_ID_CHARS)]] = Field(
        min_length=1, max_length=MAX_GPUS_PER_NODE, description="The stage's TP group, one node's GPUs; tp is their count."
    )
    layers: tuple[int, int] = Field(description="Half-open [first, last) transformer layers, as in a plan's stages.")
    cp: int = Field(default=1, ge=1, le=1024, description="A plan's stage cp, accepted so that its replicas fit here "
                    "as they are; replica-by-replica estimates price cp 1 only (give a CP layout by shape: tp, cp, "
                    "pp, dp).")

    @field_validator("devices")
    @classmethod
    def _device_form(cls, value: list[str]) -> list[str]:
        return [_checked_device(device, "layout stage") for device in value]


class LayoutReplica(_Strict):
    num_microbatches: int = Field(ge=1, le=MAX_GLOBAL_BATCH_SEQUENCES)
    stages: list[LayoutStage] = Field(min_length=1, max_length=1024)


class Layout(_Strict):
    tp: int | None = Field(default=None, ge=1, le=MAX_GPUS_PER_NODE, description="Required unless replicas are given.")
    pp: int | None = Field(default=None, ge=1, le=1024, description="Required unless replicas are given.")
    micro_batch_size: int | None = Field(
        default=None, ge=1, le=4096, description="Default: training.micro_batch_size, else 1; if both are given they "
        "must agree.")
    virtual_stages: int = Field(default=1, ge=1, le=64)
    schedule: EstimateSchedule = "1f1b"
    recompute: Literal["none", "selective", "full"] | None = Field(
        default=None, description="Default: training.recompute unless it is auto, else selective; if both are given "
        "they must agree.")
    layers_per_stage: list[int] | None = Field(default=None, max_length=1024)
    layers_per_chunk: list[int] | None = Field(
        default=None, max_length=65_536, description="Interleaved layouts (virtual_stages >= 2): the transformer "
        "layers of each model chunk, pp x virtual_stages positive counts, chunk c of stage s at index c x pp + s "
        "(the order of Megatron's --pipeline-model-parallel-layout), e.g. Llama 3.1 405B's 126 layers at pp 8, "
        "virtual_stages 8 as Megatron-Bridge runs them: [1, 2 x 62, 1]. Omitted: each stage's layers cut into "
        "virtual_stages equal chunks.")
    dp: int | None = Field(default=None, ge=1, description="Replicas; default as many as the healthy devices allow.")
    cp: int = Field(default=1, ge=1, le=1024, description="Context-parallel ranks splitting each sequence: a stage "
                    "runs on tp x cp GPUs, inside a node or on whole nodes. Needs flash attention and a seq_length "
                    "that cuts into 2 cp equal chunks.")
    ep: int = Field(default=1, ge=1, le=4096, description="Expert parallelism of a mixture-of-experts model: each "
                    "stage's routed experts split over ep GPUs (Megatron's --expert-model-parallel-size), in "
                    "ep x etp / tp consecutive replicas; ep divides the experts, that replica count divides dp, cp 1.")
    etp: int | None = Field(default=None, ge=1, le=1024, description="Expert tensor parallelism: each routed expert "
                            "split over etp GPUs (Megatron's --expert-tensor-parallel-size); divides tp, and tp / etp "
                            "divides ep. Omitted: tp.")
    dp_shard: int | None = Field(
        default=None, ge=1, le=1_048_576, description="Replicas whose ZeRO state (zero_stage 1-3) is sharded together: "
        "dp_shard consecutive replicas form a shard group and the dp / dp_shard groups hold the same shards and "
        "all-reduce them (hybrid sharding, HSDP). Divides dp; omitted: all dp replicas (full sharding). With "
        "zero_stage 0, 1 or omitted.")
    replicas: list[LayoutReplica] | None = Field(
        default=None, min_length=1, max_length=MAX_LIST_LENGTH,
        description="Every replica spelled out (a plan's `replicas` fit here as they are: extra stage fields are "
        "not allowed, so send `devices` and `layers` of each stage): any layout the planner can return, "
        "non-uniform ones included. Instead of tp, pp, dp and layers_per_stage.",
    )

    @model_validator(mode="after")
    def _one_form(self) -> Layout:
        if self.replicas is not None:
            given = [name for name in ("tp", "pp", "dp", "layers_per_stage", "layers_per_chunk")
                     if getattr(self, name) is not None]
            given += [name for name in ("cp", "ep") if getattr(self, name) != 1]
            given += ["etp"] if self.etp is not None else []
            given += ["dp_shard"] if self.dp_shard is not None else []
            if given:
                raise ValueError(f"give either replicas or {', '.join(given)}, not both: replicas fix every stage")
        elif self.tp is None or self.pp is None:
            raise ValueError("give tp and pp (and optionally dp, layers_per_stage), or replicas")
        return self


class EstimateRequest(PlanRequest):
    layout: Layout

    @model_validator(mode="after")
    def _one_value_each(self) -> EstimateRequest:
        """A setting both `training` and `layout` can give applies once: given in one, it applies; given in both,
        the two must agree (which would win is a guess the estimate must not make)."""
        training, layout = self.training, self.layout
        if training.zero_stage == "auto":
            raise ValueError("training.zero_stage auto is a planner's choice; an estimate prices one stage: give 0, 1, 2 "
                             "or 3")
        pairs = [("micro_batch_size", training.micro_batch_size, layout.micro_batch_size, 1),
                 ("recompute", None if training.recompute == "auto" else training.recompute, layout.recompute,
                  "selective")]
        conflicts = [f"training.{name} {given} vs layout.{name} {stated}"
                     for name, given, stated, _ in pairs if None not in (given, stated) and given != stated]
        if conflicts:
            raise ValueError(f"{'; '.join(conflicts)}: give it once, or make them agree")
        self.layout = layout.model_copy(update={name: next(v for v in (stated, given, default) if v is not None)
                                                for name, given, stated, default in pairs})
        return self


class Stage(BaseModel):
    id: int
    layers: tuple[int, int] = Field(description="Half-open [first, last) transformer layers. With virtual_stages "
                                    "above 1 it counts the stage's layers in stage order: its model chunks hold the "
                                    "runs of virtual stages c x pp + id (chunk_layers, or equal chunks).")
    devices: list[str]
    tp: int
    memory_gib: float
    forward_ms: float
    backward_ms: float
    speed: float = Field(default=1.0, description="Slowest member's speed; with expert parallelism (`ep`), the "
                         "slowest of its EP group at this stage, whose pace it runs at.")
    weight_grad_ms: float = Field(
        default=0.0, description="Part of backward_ms computing weight gradients (W in zero-bubble schedules)."
    )
    activation_gib: float = Field(default=0.0, description="Activations one in-flight microbatch keeps on the stage.")
    static_memory_gib: float = Field(default=0.0, description="memory_gib minus activations: weights, gradients, "
        "optimizer state, FP8 weight caches, ZeRO-3's gathered layers, the head's logits; not memory_reserve_gib.")
    cp: int = Field(default=1, description="Context-parallel ranks splitting each sequence: devices holds tp x cp "
                    "GPUs, tp consecutive ones per CP rank (Megatron's rank order).")
    chunk_layers: list[int] | None = Field(
        default=None, description="Layers of each of the stage's model chunks (chunk c is virtual stage c x pp + "
        "id), where an estimate's layers_per_chunk cut them unevenly; null: `layers` cut into the plan's "
        "virtual_stages equal chunks.")


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
    cp_comm_s: float = Field(default=0.0, description="Context parallelism's key/value exchange that attention "
                             "does not hide.")
    ep_comm_s: float = Field(default=0.0, description="Expert parallelism's all-to-all dispatch and combine of "
                             "routed tokens.")


class Predicted(BaseModel):
    iteration_time_s: float
    tokens_per_s: float
    mfu: float
    breakdown: Breakdown
    calibration_id: str | None = Field(default=None, description="The stored calibration whose parameters priced "
                                       "this plan; null: the built-in ones.")
    calibration_extrapolates: list[str] = Field(
        default_factory=list, description="Each way this plan goes beyond what the calibration's runs span "
        "(calibration.covers: GPU, NVLink topology, precision, TP, CP and EP degrees, model size, tokens per "
        "microbatch), where its fitted parameters extrapolate; empty inside the span or without a calibration.")


class SolverReport(BaseModel):
    status: str
    wall_time_s: float
    gap: float
    objective_ms: float | None = Field(
        default=None, description="1000 x predicted.iteration_time_s: the number the search minimizes and reports.")
    bound_ms: float | None = Field(
        default=None, description="A lower bound on objective_ms over every layout of the searched space (README, "
        "\"What a plan decides\") under every allowed schedule; status is OPTIMAL, gap 0, exactly when it meets "
        "objective_ms.")
    candidates_total: int | None = None
    candidates_solved: int | None = None
    time_limit_s: float | None = Field(
        default=None, description="The limit this answer was computed under, counted from arrival: the request's "
        "options.time_limit_s, at most the server's cap, raised to the least this request takes (see notes).")
    notes: list[str] = Field(
        default_factory=list, description="What the answer gave up to arrive in time, or why its limit was raised.")
    stopped_by: Literal["search finished", "work budget", "wall clock"] | None = Field(
        default=None, description="What ended the search. `search finished`: it ran to its end (the answer is "
        "proven where bound_ms meets objective_ms; a remaining gap is what the bounds could not close). `work budget`: "
        "the time limit, counted in the planner's own work (units of search priced in seconds, CP-SAT deterministic time), ran out first; "
        "the same request gives the same plan on a loaded machine. `wall clock`: the machine was so loaded that "
        "the wall-clock safety net took over, and the plan may differ from an idle machine's. Null: no search "
        "(an estimate).")


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


class CompareChange(BaseModel):
    """One difference between the user's layout and the best plan, applied alone to the user's layout."""

    change: str = Field(description='What changes, e.g. "micro_batch_size 1 → 4".')
    iteration_time_s: float | None = Field(description="The user's layout with only this change; null when it "
                                           "cannot run (`why` says why).")
    gain: float | None = Field(description="Share of the user's iteration time this change alone saves (negative: it "
                               "costs); null when it cannot run.")
    why: str | None = None


class PlanComparison(BaseModel):
    """On a layout `/v1/compare` stored: the best plan it was compared with (stored too) and the ranked changes."""

    best_plan_id: str
    best: Predicted
    best_most_memory_gib: float = Field(description="The best plan's fullest stage, GiB per GPU.")
    speedup: float
    planner_slower: bool
    changes: list[CompareChange]


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
    comparison: PlanComparison | None = Field(
        default=None, description="Only on a layout `/v1/compare` compared: the best plan's id and figures and what "
        "each difference buys; the plan page shows them.")
    gpu_memory_gib: float | None = Field(default=None, description="HBM capacity of one GPU, GiB.")
    gpu: str | None = Field(default=None, description="The GPU the plan is priced for: a preset's name (GET /v1/gpus) "
                            "or a custom GPU's own; null for plans stored before it was recorded.")
    attention_kernel: Literal["fused", "fa2"] | None = Field(
        default=None, description="The attention kernels the plan is priced with (training.attention_kernel); null "
        "for plans stored before it was recorded (fused).")
    memory_reserve_gib: float | None = Field(
        default=None, description="GiB per GPU the plan leaves free for the CUDA context, NCCL buffers and the "
        "allocator (options.memory_reserve_gib or its default): every stage's memory_gib fits gpu_memory_gib less this.")
    ep: int = Field(default=1, ge=1, description="Expert parallelism (mixture-of-experts models): each stage's routed "
                    "experts split over ep GPUs, which exchange tokens all-to-all. With n = ep x etp / tp (ep with "
                    "etp null), replicas 0..n-1, n..2n-1, ... form the EP groups (Megatron's rank order), and a stage "
                    "runs at the pace of the slowest of its EP group (its `speed`).")
    etp: int | None = Field(default=None, ge=1, description="Expert tensor parallelism: each routed expert split over "
                            "etp GPUs of a stage's TP group; null: tp (Megatron's default, and every dense model).")
    grad_precision: Literal["fp32", "bf16"] | None = Field(
        default=None, description="The dtype gradients are reduced in (training.grad_precision) and, but with "
        "optimizer_precision bf16 (bf16), accumulate in; null for fp16 training (fp32 accumulation, fp16 reduction) "
        "and plans stored before it was recorded (fp32).")
    optimizer_precision: Literal["fp32", "bf16"] | None = Field(default=None, description="The optimizer state priced "
        "(training.optimizer_precision); null for plans stored before it was recorded (fp32).")
    moe_dispatcher: Literal["alltoall", "flex"] | None = Field(
        default=None, description="The token dispatcher a mixture of experts' plan is priced with "
        "(training.moe_dispatcher); null for dense models and plans stored before it was recorded (alltoall).")
    moe_a2a_overlap: bool = Field(
        default=False, description="Whether the plan's all-to-alls are priced under Megatron's batch-level EP "
        "overlap (training.moe_a2a_overlap, on a layout megatron-core runs it on); the Megatron-LM export then "
        "asks for it.")
    tp_comm_overlap: Literal["none", "megatron", "async_tp"] | None = Field(
        default=None, description="How the plan's tensor-parallel collectives are priced (training.tp_comm_overlap): "
        "none, megatron (Megatron-LM's --tp-comm-overlap) or async_tp (PyTorch's asynchronous TP); the exports ask "
        "their trainer for it. Null for plans stored before it was recorded (none).")
    dp_shard: int | None = Field(
        default=None, ge=1, description="Replicas of one ZeRO shard group (consecutive replica ids): each GPU holds "
        "1/(dp_shard x cp) of its stage's sharded state, and replicas r and r + dp_shard hold the same shards "
        "(hybrid sharding when below the replica count; the replica count: full sharding; 1 with zero_stage 0). "
        "Null where replicas differ in shape (non-uniform plans shard over the replicas holding each layer).")
    stored: bool | None = Field(
        default=None, description="Only in an answer, and only false: the plan store was unavailable, so this plan "
        "was not kept; reading it back by id (GET, exports, replan, detect) answers 404.")


class FieldError(BaseModel):
    field: str = Field(description="Path of the failing value in the request, e.g. `failures.slow[0].speed`.")
    message: str


class ErrorDetail(BaseModel):
    """Every error answer: `detail` is one sentence for people; `errors` lists the failing fields of a
    request that did not validate."""

    detail: str
    errors: list[FieldError] | None = None


class ReplanRequest(_Strict):
    """The complete failure state now; options not given are the parent request's."""

    failures: Failures = Field(default_factory=Failures)
    options: Options | None = Field(
        default=None, description="Only the fields given change the parent request's options, e.g. "
        "{\"time_limit_s\": 5, \"amortize_iterations\": 1000}.")
