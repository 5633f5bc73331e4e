"""Turn a search result into concrete device assignments and predicted figures.

Placement follows Megatron's rank order (tp fastest, then dp, then pp): the
same stage of consecutive replicas shares a node, which is what the cost
model assumes for the data-parallel all-reduce. Degraded TP groups go where
the search put them (`planner.uniform.placements`).
"""

from __future__ import annotations

from cost_models.device import device_id
from cost_models.efficiency import tp_overlap_name
from cost_models.expert_parallel import a2a_overlap_applies
from cost_models.flops import iteration_model_flops
from cost_models.hardware import GIB
from cost_models.iteration import StageTime, exposed_dp_sync_ms, exposed_param_gather_ms, stage_time
from cost_models.stage_costs import StageCostTerms
from planner.devices import Slot, slot_inventory
from planner.problem import PlanningProblem
from planner.result import (
    PlanResult,
    PredictedResult,
    ReplicaResult,
    SolverResult,
    StageResult,
    stage_schedule_fields,
)
from planner.schedules.ops import GradSync
from planner.uniform.launch import node_slots, placement_grid
from planner.uniform.placements import Placement, degraded_speeds_used, expert_group_pace, packed
from planner.uniform.search import SearchResult


def _full_speed_slots(problem: PlanningProblem, tp: int) -> list[Slot]:
    """Every full-speed TP group, node by node."""
    return [slot for full, _ in node_slots(problem.cluster, tp).values() for slot in full]


def _degraded_slots(problem: PlanningProblem, tp: int) -> list[Slot]:
    return list(slot_inventory(problem.cluster, tp).degraded)


def place_slots(problem: PlanningProblem, tp: int, pp: int, dp: int, placement: Placement | None = None) -> list[list[Slot]]:
    """slots[replica][stage] for the fastest dp * pp TP groups, degraded ones where `placement` puts them
    (default: packed into the first replicas, middle stages first)."""
    full = _full_speed_slots(problem, tp)
    if placement is None:
        placement = packed(degraded_speeds_used(slot_inventory(problem.cluster, tp), pp, dp), pp, dp)
    needed_degraded = max(0, dp * pp - len(full))
    # Slowest first, like the speeds a placement lists; groups of equal speed are interchangeable.
    by_speed: dict[float, list[Slot]] = {}
    for slot in sorted(_degraded_slots(problem, tp)[:needed_degraded], key=lambda s: s.speed):
        by_speed.setdefault(slot.speed, []).append(slot)
    grid: list[list[Slot | None]] = [
        [by_speed[speed].pop(0) if speed < 1.0 else None for speed in row] for row in placement.rows
    ]
    remaining = iter(full)
    for stage in range(pp):
        for replica in range(dp):
            if grid[replica][stage] is None:
                grid[replica][stage] = next(remaining)
    return [[slot for slot in row if slot is not None] for row in grid]


def _paced(grid: list[list[Slot]], expert_replicas: int) -> tuple[tuple[float, ...], ...]:
    """Each replica's stage speeds in `grid` as its expert-parallel group (`expert_replicas` replicas) paces them."""
    return expert_group_pace(tuple(tuple(slot.speed for slot in row) for row in grid), expert_replicas)


def stage_grad_sync(terms: StageCostTerms, stage: int, layers: int) -> GradSync:
    """A uniform layout's stage's gradient sync: whole, its last bucket, and the 1F1B model's exposed part
    (at full speed, as `estimate_iteration` prices it: the sync waits for the full-speed peers too)."""
    healthy = stage_time(terms, stage, layers)
    if terms.shape.grad_sync_ranks <= 1:
        return GradSync(0.0, 0.0, 0.0)
    full_ms = terms.dp_sync_ms(healthy.params)
    bucket_ms = terms.dp_sync_ms(min(terms.bucket_params, healthy.params)) if terms.overlap_grad_reduce else full_ms
    return GradSync(full_ms, bucket_ms, exposed_dp_sync_ms(terms, healthy), exposed_param_gather_ms(terms, healthy))


def stage_figures(timing: StageTime) -> dict[str, float]:
    """A stage's figures as a plan reports them (rounded as on the wire; schedules are simulated on these)."""
    return dict(
        memory_gib=round(timing.memory_bytes / GIB, 3),
        forward_ms=round(timing.forward_ms, 3),
        backward_ms=round(timing.backward_ms, 3),
        **stage_schedule_fields(timing),
    )


def assemble_plan(problem: PlanningProblem, found: SearchResult) -> PlanResult:
    terms = found.candidate.terms
    shape = terms.shape
    placement = found.placement
    if placement is None and shape.expert_replicas > 1:
        placement = packed(degraded_speeds_used(slot_inventory(problem.cluster, shape.group_size), shape.pp,
                                                shape.dp), shape.pp, shape.dp)
    grid = None
    if placement is not None:  # a device order stock launchers can start
        grid = placement_grid(problem, shape.group_size, shape.pp, shape.dp, placement)
        # It may reorder replicas; with expert parallelism that regroups them, kept only if every group
        # then runs at the pace that was priced (else the placement's own order, whose groups were).
        if grid is not None and shape.expert_replicas > 1 and sorted(_paced(grid, shape.expert_replicas)) != sorted(
                expert_group_pace(placement.rows, shape.expert_replicas)):
            grid = None
    if grid is None:
        grid = place_slots(problem, shape.group_size, shape.pp, shape.dp, placement)
    paced = _paced(grid, shape.expert_replicas)

    bounds = []
    first = 0
    for count in found.layers_per_stage:
        bounds.append((first, first + count))
        first += count

    used: set[tuple[int, int]] = set()
    replicas = []
    # A stage's figures depend on its position and speed only: once each, not once per replica
    # (two fifths of assembling a 131,072-GPU plan).
    figures: dict[tuple[int, float], dict] = {}
    for replica_id, row in enumerate(grid):
        stages = []
        for stage_id, slot in enumerate(row):
            speed = paced[replica_id][stage_id]
            key = (stage_id, speed)
            if key not in figures:
                layers = found.layers_per_stage[stage_id]
                figures[key] = {**stage_figures(stage_time(terms, stage_id, layers, speed)),
                                "grad_sync": stage_grad_sync(terms, stage_id, layers)}
            members = slot.members
            used.update(members)
            stages.append(StageResult(
                id=stage_id,
                layers=bounds[stage_id],
                devices=tuple(device_id(node, g) for node, g in members),
                tp=shape.tp,
                cp=shape.cp,
                speed=speed,
                **figures[key],
            ))
        replicas.append(ReplicaResult(id=replica_id, num_microbatches=terms.num_microbatches, stages=tuple(stages)))

    solver = SolverResult(
        status="OPTIMAL" if found.optimal else "FEASIBLE",
        wall_time_s=round(found.wall_time_s, 3),
        gap=round(found.gap, 6),
        objective_ms=round(found.objective_ms, 3),
        bound_ms=round(found.bound_ms, 3),
        candidates_total=found.candidates_total,
        candidates_solved=found.candidates_solved,
    )
    return finish_plan(
        problem, tuple(replicas), used, found.objective_ms, found.estimate.breakdown_s, solver,
        micro_batch_size=shape.micro_batch_size, schedule=shape.schedule,
        virtual_stages=shape.virtual_stages, recompute=shape.recompute, ep=shape.ep, dp_shard=shape.shard_replicas,
        etp=shape.etp,
        moe_a2a_overlap=problem.software.moe_a2a_overlap and a2a_overlap_applies(
            shape.ep, shape.pp, shape.virtual_stages, shape.recompute),
    )


def is_uniform(replicas: tuple[ReplicaResult, ...]) -> bool:
    """API.md invariant 6: same stage count, TP (and CP) per position, layer split and microbatches."""
    signatures = {
        (tuple((s.tp, s.cp) for s in r.stages), tuple(s.layers for s in r.stages), r.num_microbatches) for r in replicas
    }
    return len(signatures) == 1


def predicted_figures(
    problem: PlanningProblem, devices_used: int, iteration_ms: float, breakdown_s: dict[str, float]
) -> PredictedResult:
    workload = problem.workload
    iteration_s = iteration_ms / 1e3
    model_flops = iteration_model_flops(workload.model, workload.seq_length, workload.global_batch_size)
    peak_flops = devices_used * problem.hardware.gpu.peak_tflops * 1e12
    return PredictedResult(
        iteration_time_s=round(iteration_s, 6),
        tokens_per_s=round(workload.global_batch_size * workload.seq_length / iteration_s, 1),
        mfu=round(model_flops / (iteration_s * peak_flops), 4),
        breakdown={k: round(v, 6) for k, v in breakdown_s.items()},
        calibration_id=problem.calibration_id,
    )


def finish_plan(
    problem: PlanningProblem,
    replicas: tuple[ReplicaResult, ...],
    used: set[tuple[int, int]],
    iteration_ms: float,
    breakdown_s: dict[str, float],
    solver: SolverResult,
    *,
    micro_batch_size: int,
    schedule: str,
    virtual_stages: int,
    recompute: str,
    ep: int = 1,
    dp_shard: int | None = None,
    etp: int | None = None,
    moe_a2a_overlap: bool = False,
) -> PlanResult:
    """Everything a plan reports beyond its replicas: device accounting, predictions, solver status.
    `dp_shard`: replicas of a ZeRO shard group (uniform plans; ZeRO-0 shards nothing: 1)."""
    cluster = problem.cluster
    excluded = sorted(cluster.failed)
    unused = [
        (node, gpu)
        for node in range(cluster.num_nodes)
        for gpu in range(cluster.gpus_per_node)
        if (node, gpu) not in used and (node, gpu) not in cluster.failed
    ]
    predicted = predicted_figures(problem, len(used), iteration_ms, breakdown_s)
    return PlanResult(
        status="optimal" if solver.status == "OPTIMAL" else "feasible",
        uniform=is_uniform(replicas),
        micro_batch_size=micro_batch_size,
        schedule=schedule,
        virtual_stages=virtual_stages,
        recompute=recompute,
        zero_stage=problem.workload.zero_stage,
        replicas=replicas,
        unused_devices=tuple(device_id(n, g) for n, g in unused),
        excluded_devices=tuple(device_id(n, g) for n, g in excluded),
        predicted=predicted,
        solver=solver,
        model=problem.model_name,
        slow_devices=tuple((device_id(n, g), speed) for (n, g), speed in sorted(cluster.slow)),
        architecture=problem.workload.model,
        global_batch_size=problem.workload.global_batch_size,
        seq_length=problem.workload.seq_length,
        precision=problem.precision,
        gpu_memory_gib=problem.hardware.gpu.memory_gib,
        gpu=problem.hardware.gpu.name,
        attention_kernel=problem.software.attention_kernel,
        memory_reserve_gib=problem.memory_reserve_gib,
        ep=ep,
        etp=etp,
        moe_a2a_overlap=moe_a2a_overlap,
        dp_shard=1 if problem.workload.zero_stage == 0 else dp_shard,
        grad_precision=None if problem.precision == "fp16" else ("bf16" if problem.software.grad_reduce_bytes == 2 else "fp32"),
        optimizer_precision="fp32" if problem.software.master_weights else "bf16",
        moe_dispatcher=problem.software.moe_dispatcher if problem.workload.model.is_moe else None,
        tp_comm_overlap=tp_overlap_name(problem.software),
    )
