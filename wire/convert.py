"""Wire models <-> planner dataclasses. Validation that needs domain knowledge lives here."""

from __future__ import annotations

from dataclasses import asdict, is_dataclass

from pydantic import ValidationError

from cost_models.device import Device
from cost_models.efficiency import SoftwareConfig
from cost_models.gpu_efficiency import builtin_efficiency
from cost_models.hardware import GpuSpec, gpu_preset, gpu_preset_names
from cost_models.layout import Hardware, Workload
from cost_models.memory import DEFAULT_MEMORY_RESERVE_GIB
from cost_models.hf_config import HfConfigError, model_from_hf_config
from cost_models.model_spec import (
    ModelSpec,
    RopeScaling,
    model_preset,
    model_preset_names,
)
from planner.devices import build_cluster_state
from planner.errors import PlanningError
from planner.estimate import FixedLayout
from planner.estimate_replicas import FixedReplica, FixedStage, ReplicaLayout
from planner.gc_pause import gc_paused
from planner.problem import PlanningProblem, default_max_context_parallel
from planner.result import PlanResult, ReplicaResult
from planner.schedules.result import ScheduleChoice
from planner.zero_choice import with_zero_stage
from wire.calibration import AppliedCalibration
from wire.schemas import (
    Cluster,
    GpuObject,
    HfConfigModel,
    Layout,
    ModelArchitecture,
    PipelineSchedule,
    Plan,
    PlanRequest,
)

# A custom GPU without HBM bandwidth gets A100-80GB's bytes per FLOP.
_REFERENCE_GPU = "A100-80GB"


def resolve_gpu(gpu: str | GpuObject) -> GpuSpec:
    if isinstance(gpu, str):
        try:
            return gpu_preset(gpu)
        except KeyError:
            raise PlanningError(f"unknown GPU preset {gpu!r}; known presets: {', '.join(gpu_preset_names())}, "
                                'or give {"name", "peak_tflops", "memory_gib"}') from None
    reference = gpu_preset(_REFERENCE_GPU)
    ratio = gpu.peak_tflops / reference.peak_tflops
    return GpuSpec(
        name=gpu.name,
        peak_tflops=gpu.peak_tflops,
        memory_gib=gpu.memory_gib,
        hbm_bandwidth_gb_s=gpu.hbm_bandwidth_gb_s or reference.hbm_bandwidth_gb_s * ratio,
        peak_fp8_tflops=gpu.peak_fp8_tflops,
        matmul_ceiling_tflops=gpu.matmul_ceiling_tflops,
        fp8_matmul_ceiling_tflops=gpu.fp8_matmul_ceiling_tflops,
        intra_node_bandwidth_gb_s=reference.intra_node_bandwidth_gb_s,
        inter_node_bandwidth_gb_s=reference.inter_node_bandwidth_gb_s,
    )


def resolve_hardware(cluster: Cluster) -> Hardware:
    gpu = resolve_gpu(cluster.gpu)
    return Hardware(
        gpu=gpu,
        gpus_per_node=cluster.gpus_per_node,
        intra_node_bandwidth_gb_s=cluster.intra_node_bandwidth_gb_s or gpu.intra_node_bandwidth_gb_s,
        inter_node_bandwidth_gb_s=cluster.inter_node_bandwidth_gb_s or gpu.inter_node_bandwidth_gb_s,
        nvlink_mesh=cluster.nvlink_topology == "mesh",
    )


def resolve_model(model: str | ModelArchitecture | HfConfigModel) -> ModelSpec:
    if isinstance(model, str):
        try:
            return model_preset(model)
        except KeyError:
            raise PlanningError(f"unknown model preset {model!r}; known presets: {', '.join(model_preset_names())}, "
                                'or give an architecture object or {"hf_config": {...}}') from None
    if isinstance(model, HfConfigModel):
        try:
            spec = model_from_hf_config(model.hf_config)
        except (HfConfigError, TypeError, ValueError) as error:
            raise PlanningError(f"hf_config: {error}") from None
        _check_shape(spec)
        return spec
    scaling = model.rope_scaling
    spec = ModelSpec(
        name=model.name,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_kv_heads=model.num_kv_heads or model.num_attention_heads,
        vocab_size=model.vocab_size,
        swiglu=model.swiglu,
        tied_embeddings=model.tied_embeddings,
        normalization=model.normalization,
        norm_epsilon=model.norm_epsilon,
        position_embedding=model.position_embedding,
        rope_theta=model.rope_theta,
        rotary_percent=model.rotary_percent,
        rope_scaling=RopeScaling(**scaling.model_dump()) if scaling is not None else None,
        max_position_embeddings=model.max_position_embeddings,
        qkv_bias=model.qkv_bias,
        linear_bias=model.linear_bias,
        num_experts=model.num_experts,
        experts_per_token=model.experts_per_token,
        shared_expert_ffn_hidden_size=model.shared_expert_ffn_hidden_size,
        head_dim=model.head_dim,
        qk_norm=model.qk_norm,
        attention_sinks=model.attention_sinks,
        sliding_window=model.sliding_window,
        full_attention_every=model.full_attention_every,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_rope_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        dense_layers=model.dense_layers,
        dense_ffn_hidden_size=model.dense_ffn_hidden_size,
        mtp_layers=model.mtp_layers,
    )
    _check_shape(spec)
    return spec


def _check_shape(spec: ModelSpec) -> None:
    """What ModelArchitecture checks, for specs that did not come through it (presets, hf_config, stored plans)."""
    try:
        ModelArchitecture.model_validate(asdict(spec))
    except ValidationError as error:
        problems = "; ".join(
            (f"{'.'.join(map(str, item['loc']))}: " if item["loc"] else "") + item["msg"].removeprefix("Value error, ")
            for item in error.errors()
        )
        raise PlanningError(f"model {problems}") from None


def model_label(model: str | ModelArchitecture | HfConfigModel, spec: ModelSpec) -> str:
    return model if isinstance(model, str) else spec.name


def to_problem(request: PlanRequest, calibration: AppliedCalibration | None = None) -> PlanningProblem:
    """Validate a request against the domain and build the planner's problem. `calibration`: the stored
    calibration `options.calibration_id` names, which the caller read from the store."""
    wanted = request.options.calibration_id
    if wanted is not None and (calibration is None or calibration.calibration_id != wanted):
        raise PlanningError(f"options.calibration_id {wanted!r} names no stored calibration "
                            "(POST /v1/calibrations answers the id of one)")
    cluster = request.cluster
    hardware = resolve_hardware(cluster)
    model = resolve_model(request.model)
    training = request.training
    if training.micro_batch_size is not None and training.global_batch_size % training.micro_batch_size:
        raise PlanningError(
            f"global_batch_size {training.global_batch_size} is not a multiple of micro_batch_size {training.micro_batch_size}"
        )
    state = build_cluster_state(
        cluster.num_nodes,
        cluster.gpus_per_node,
        request.failures.failed,
        [(s.device, s.speed) for s in request.failures.slow],
    )
    if training.attention_kernel == "fa2" and hardware.gpu.peak_fp8_tflops is None:
        raise PlanningError(f"training.attention_kernel fa2 prices FlashAttention-2 on a Hopper or newer GPU; on the "
                            f"{hardware.gpu.name} (no FP8 tensor cores: Ampere or older) FlashAttention-2 is the fused "
                            'kernel: leave attention_kernel "fused"')
    if training.precision == "fp8" and hardware.gpu.peak_fp8_tflops is None:
        with_fp8 = ", ".join(name for name in gpu_preset_names() if gpu_preset(name).peak_fp8_tflops is not None)
        raise PlanningError(f"training.precision fp8 needs FP8 tensor cores; the {hardware.gpu.name} has none "
                            f"(presets with FP8: {with_fp8}; a custom GPU object gives peak_fp8_tflops)")
    # fp16 training reduces fp16 gradients accumulated in fp32; bf16 and fp8 (whose gradients leave the GEMMs in
    # bf16) accumulate and reduce them in fp32, Megatron's default, or in bf16 when asked.
    # A model trained in bf16 without master weights keeps its gradients in bf16 too (torch's own dtype rule); they
    # are still reduced in fp32 unless grad_precision says bf16 (FSDP2's reduce_dtype).
    bf16_grads = training.grad_precision == "bf16"
    master_weights = training.optimizer_precision == "fp32"
    if not master_weights and training.precision == "fp16":
        raise PlanningError("training.optimizer_precision bf16 with precision fp16: fp16 training needs fp32 master "
                            "weights for its loss scaling; use precision bf16")
    software = SoftwareConfig(grad_reduce_bytes=2 if training.precision == "fp16" or bf16_grads else 4,
                              grad_bytes=2 if bf16_grads or not master_weights else 4, fp8=training.precision == "fp8",
                              master_weights=master_weights,
                              moe_dispatcher=training.moe_dispatcher, moe_a2a_overlap=training.moe_a2a_overlap,
                              attention_kernel=training.attention_kernel,
                              tp_comm_overlap=training.tp_comm_overlap == "megatron",
                              async_tp=training.tp_comm_overlap == "async_tp")
    reserve_gib = request.options.memory_reserve_gib
    if reserve_gib is None:
        reserve_gib = DEFAULT_MEMORY_RESERVE_GIB
    elif reserve_gib >= hardware.gpu.memory_gib:
        raise PlanningError(
            f"options.memory_reserve_gib {reserve_gib:g} leaves nothing of a {hardware.gpu.name}'s "
            f"{hardware.gpu.memory_gib:g} GiB for the model; it must be below the GPU's memory"
        )
    zero_stage = 1 if training.zero_stage == "auto" else training.zero_stage
    problem = PlanningProblem(
        hardware=hardware,
        cluster=state,
        # With zero_stage auto the planner sets the stage per search (planner.zero_choice); 1 holds its place.
        workload=Workload(model, training.seq_length, training.global_batch_size, zero_stage),
        model_name=model_label(request.model, model),
        micro_batch_size=training.micro_batch_size,
        recompute=training.recompute,
        precision=training.precision,
        stock_layouts_only=not request.options.allow_non_uniform,
        zero_stage_auto=training.zero_stage == "auto",
        time_limit_s=request.options.time_limit_s,
        random_seed=request.options.random_seed,
        schedules=frozenset(request.options.schedules) if request.options.schedules is not None else None,
        memory_reserve_gib=reserve_gib,
        max_context_parallel=(request.options.max_context_parallel if request.options.max_context_parallel is not None
                              else default_max_context_parallel(training.seq_length)),
        max_expert_parallel=request.options.max_expert_parallel,
        allow_hybrid_sharding=request.options.allow_hybrid_sharding,
        efficiency=calibration.parameters if calibration is not None else builtin_efficiency(hardware.gpu),
        calibration_id=calibration.calibration_id if calibration is not None else None,
        software=software,
    )
    # ZeRO-2/3 plan stock layouts (planner.zero_choice.with_zero_stage says why).
    return with_zero_stage(problem, zero_stage) if not problem.zero_stage_auto else problem


@gc_paused()
def to_fixed_layout(layout: Layout) -> FixedLayout | ReplicaLayout:
    """An estimate request's layout as the planner's fixed layout: by shape, or replica by replica."""
    if layout.replicas is not None:
        split = sorted({stage.cp for replica in layout.replicas for stage in replica.stages} - {1})
        if split:
            raise PlanningError(f"layout.replicas: stages with context parallelism (cp {', '.join(map(str, split))}) "
                                "are estimated by shape only: give tp, cp, pp and dp instead of replicas")
        return ReplicaLayout(
            replicas=tuple(
                FixedReplica(
                    num_microbatches=replica.num_microbatches,
                    stages=tuple(
                        FixedStage(devices=tuple((d.node, d.gpu) for d in map(Device.parse, stage.devices)),
                                   layers=tuple(stage.layers))
                        for stage in replica.stages
                    ),
                )
                for replica in layout.replicas
            ),
            micro_batch_size=layout.micro_batch_size,
            virtual_stages=layout.virtual_stages,
            schedule=layout.schedule,
            recompute=layout.recompute,
        )
    return FixedLayout(
        tp=layout.tp,
        pp=layout.pp,
        micro_batch_size=layout.micro_batch_size,
        virtual_stages=layout.virtual_stages,
        schedule=layout.schedule,
        recompute=layout.recompute,
        layers_per_stage=tuple(layout.layers_per_stage) if layout.layers_per_stage is not None else None,
        layers_per_chunk=tuple(layout.layers_per_chunk) if layout.layers_per_chunk is not None else None,
        dp=layout.dp,
        cp=layout.cp,
        ep=layout.ep,
        dp_shard=layout.dp_shard,
        etp=layout.etp,
    )


def to_wire(result: PlanResult, plan_id: str, **extra) -> Plan:
    # Cyclic collections paused: they rescanned the plan's hundreds of thousands of fresh objects
    # for nothing, half of this function's time at 65,536 GPUs.
    fields = {name: getattr(result, name) for name in result.__dataclass_fields__}
    choice = fields.pop("pipeline_schedule")
    body = {name: asdict(value) if is_dataclass(value) else value for name, value in fields.items()}
    body["replicas"] = [_replica_fields(replica) for replica in result.replicas]
    body["pipeline_schedule"] = schedule_to_wire(choice) if choice is not None else None
    body["slow_devices"] = [{"device": device, "speed": speed} for device, speed in result.slow_devices]
    return Plan.model_validate({"plan_id": plan_id, **body, **extra})


def _replica_fields(replica: ReplicaResult) -> dict:
    """`asdict` without its deep copies of every device id: a third of a second at 65,536 GPUs."""
    stages = [{name: getattr(stage, name) for name in stage.__dataclass_fields__} for stage in replica.stages]
    return {"id": replica.id, "num_microbatches": replica.num_microbatches, "stages": stages}


def schedule_to_wire(choice: ScheduleChoice) -> PipelineSchedule:
    """Times rounded to a microsecond: enough for a Gantt chart, small for 64 stages x 512 microbatches.

    Built as plain data and validated once: a timeline has a few hundred thousand ops on a large
    damaged cluster, and per-stage model objects cost three times as much. Replicas of one shape
    share their schedule's op objects, so each op's label is made once."""
    labels: dict[int, str] = {}

    def label(op) -> str:
        # By identity: hashing the frozen dataclass costs more than making the label.
        text = labels.get(id(op))
        if text is None:
            text = labels[id(op)] = op.label()
        return text

    replicas = [
        {
            "replica_ids": list(timeline.replica_ids),
            "schedule": timeline.schedule.name,
            "makespan_ms": round(timeline.simulation.makespan_ms, 3),
            "bubble_fraction": round(timeline.simulation.bubble_fraction, 4),
            "stages": [
                {
                    "stage": stage,
                    "ops": [label(item.op) for item in ops],
                    "start_ms": [round(item.start_ms, 3) for item in ops],
                    "end_ms": [round(item.end_ms, 3) for item in ops],
                    "busy_ms": round(timeline.simulation.busy_ms[stage], 3),
                    "peak_activation_gib": round(timeline.simulation.peak_activation_gib[stage], 3),
                }
                for stage, ops in enumerate(timeline.simulation.timelines)
            ],
        }
        for timeline in choice.replicas
    ]
    return PipelineSchedule.model_validate({
        "name": choice.name,
        "bubble_fraction": round(choice.slowest.simulation.bubble_fraction, 4),
        "candidates_ms": {name: round(ms, 3) for name, ms in choice.candidates_ms},
        "replicas": replicas,
    })


