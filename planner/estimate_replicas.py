"""One fixed layout given replica by replica, no search: any layout the planner can return.

A user (or an oracle enumerating layouts) names every stage's devices and layers and every replica's
microbatches; this prices exactly that layout with the cost model the non-uniform search uses: each
stage a TP group as fast as its slowest GPU, each replica its own pipeline, gradients synchronized by
the hierarchical all-reduce when every replica has the same TP sizes and layer split and by the
resharding one otherwise. The schedule named is simulated as given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cost_models.choices import Recompute, ScheduleName
from cost_models.device import device_id
from cost_models.hardware import GIB
from cost_models.resharding import nonuniform_iteration_ms
from planner.assemble import finish_plan
from planner.budget import Budget
from planner.errors import InfeasibleError, PlanningError
from planner.nonuniform.assemble import breakdown_s
from planner.nonuniform.partitions import StageType
from planner.nonuniform.templates import (
    OuterChoice,
    Template,
    TermsCache,
    stage_timings,
    template_costs,
)
from planner.problem import PlanningProblem
from planner.reported import as_fixed_layout, refuse_overflow
from planner.result import (
    PlanResult,
    ReplicaResult,
    SolverResult,
    StageResult,
    stage_schedule_fields,
)
from planner.schedules.for_plan import with_schedules
from planner.schedules.handcrafted import CHUNKED_NAMES


@dataclass(frozen=True)
class FixedStage:
    devices: tuple[tuple[int, int], ...]  # (node, gpu)
    layers: tuple[int, int]  # half-open


@dataclass(frozen=True)
class FixedReplica:
    num_microbatches: int
    stages: tuple[FixedStage, ...]


@dataclass(frozen=True)
class ReplicaLayout:
    replicas: tuple[FixedReplica, ...]
    micro_batch_size: int = 1
    virtual_stages: int = 1
    schedule: str = ScheduleName.ONE_F_ONE_B
    recompute: str = Recompute.SELECTIVE


def _check_devices(problem: PlanningProblem, layout: ReplicaLayout) -> None:
    cluster = problem.cluster
    model = problem.workload.model
    owner: dict[tuple[int, int], str] = {}
    for r, replica in enumerate(layout.replicas):
        for s, stage in enumerate(replica.stages):
            where = f"replica {r} stage {s}"
            for node, gpu in stage.devices:
                name = device_id(node, gpu)
                if node >= cluster.num_nodes or gpu >= cluster.gpus_per_node:
                    raise PlanningError(f"{where}: device {name} is not in a cluster of {cluster.num_nodes} nodes x "
                                        f"{cluster.gpus_per_node} GPUs")
                if (node, gpu) in cluster.failed:
                    raise PlanningError(f"{where}: device {name} is listed as failed")
                if (node, gpu) in owner:
                    raise PlanningError(f"{where}: device {name} is already used by {owner[(node, gpu)]}")
                owner[(node, gpu)] = where
            if len({node for node, _ in stage.devices}) > 1:
                raise PlanningError(f"{where}: a TP group must sit in one node; devices "
                                    f"{[device_id(*d) for d in stage.devices]} span several")
            tp = len(stage.devices)
            if model.num_attention_heads % tp or model.num_kv_heads % tp:
                raise PlanningError(f"{where}: tp {tp} (its device count) must divide the {model.num_attention_heads} "
                                    f"attention heads and {model.num_kv_heads} KV heads")


def _check_split(problem: PlanningProblem, layout: ReplicaLayout) -> None:
    layers = problem.workload.model.num_layers
    v = layout.virtual_stages
    for r, replica in enumerate(layout.replicas):
        first = 0
        for s, stage in enumerate(replica.stages):
            start, end = stage.layers
            if start != first or end <= start:
                raise PlanningError(f"replica {r} stage {s}: layers {list(stage.layers)} must start at layer {first} "
                                    "(where the previous stage ended) and hold at least one layer")
            if (end - start) % v:
                raise PlanningError(f"replica {r} stage {s}: {end - start} layers cannot be cut into "
                                    f"virtual_stages={v} equal chunks")
            first = end
        if first != layers:
            raise PlanningError(f"replica {r}: its stages end at layer {first}; the model has {layers}")
        if v > 1 and len(replica.stages) < 2:
            raise PlanningError(f"replica {r}: the interleaved schedule needs at least 2 stages")


def _check_schedule(problem: PlanningProblem, layout: ReplicaLayout) -> None:
    v, schedule = layout.virtual_stages, layout.schedule
    if (schedule in CHUNKED_NAMES) != (v > 1):
        raise PlanningError(f"schedule {schedule} with virtual_stages={v}: {' and '.join(CHUNKED_NAMES)} run 2 or more "
                            "model chunks per stage, every other schedule one")
    batch = problem.workload.global_batch_size
    sequences = sum(r.num_microbatches for r in layout.replicas) * layout.micro_batch_size
    if sequences != batch:
        raise PlanningError(f"the replicas' microbatches x micro_batch_size {layout.micro_batch_size} make {sequences} "
                            f"sequences; global_batch_size is {batch}")


def _templates(problem: PlanningProblem, layout: ReplicaLayout, cache: TermsCache, base: StageType) -> list[Template]:
    cluster = problem.cluster
    out = []
    for replica in layout.replicas:
        types = tuple(StageType(len(s.devices), min(cluster.speed_of(*d) for d in s.devices)) for s in replica.stages)
        split = tuple(end - start for start, end in (s.layers for s in replica.stages))
        out.append(template_costs(problem, cache, types, split, base, len(layout.replicas)))
    return out


def _replica_results(
    problem: PlanningProblem, layout: ReplicaLayout, cache: TermsCache, templates: Sequence[Template]
) -> list[ReplicaResult]:
    capacity = problem.usable_memory_bytes
    out = []
    for r, (replica, template) in enumerate(zip(layout.replicas, templates)):
        stages = []
        for s, (stage, stage_type, timing) in enumerate(zip(replica.stages, template.stage_types,
                                                            stage_timings(cache, template))):
            # One microbatch in flight at least; the schedule's own peak is checked once simulated
            # (`refuse_overflow`), with the replica's real microbatch count.
            least_bytes = timing.static_memory_bytes + timing.activation_bytes_per_microbatch
            if least_bytes > capacity:
                raise InfeasibleError(
                    f"replica {r} stage {s} ({stage.layers[1] - stage.layers[0]} layers, tp={stage_type.tp}, "
                    f"micro_batch_size={layout.micro_batch_size}, recompute={layout.recompute}) needs "
                    f"{least_bytes / GIB:.1f} GiB per GPU with one microbatch in flight; "
                    f"{problem.capacity_text()}"
                )
            stages.append(StageResult(
                id=s, layers=stage.layers, devices=tuple(device_id(*d) for d in stage.devices), tp=stage_type.tp,
                memory_gib=round(timing.memory_bytes / GIB, 3), forward_ms=round(timing.forward_ms, 3),
                backward_ms=round(timing.backward_ms, 3), speed=stage_type.speed, **stage_schedule_fields(timing),
            ))
        out.append(ReplicaResult(id=r, num_microbatches=replica.num_microbatches, stages=tuple(stages)))
    return out


def estimate_replicas(problem: PlanningProblem, layout: ReplicaLayout, simulate: bool = True) -> PlanResult:
    """The layout's plan with its named schedule simulated (`simulate=False`: the bubble model only)."""
    started = time.monotonic()
    _check_devices(problem, layout)
    _check_split(problem, layout)
    _check_schedule(problem, layout)
    count = len(layout.replicas)
    used = {d for replica in layout.replicas for stage in replica.stages for d in stage.devices}
    tp = max(len(stage.devices) for replica in layout.replicas for stage in replica.stages)
    stages = max(len(replica.stages) for replica in layout.replicas)
    outer = OuterChoice(tp, stages, layout.micro_batch_size, layout.recompute, layout.virtual_stages)
    # Pipeline sends are priced by the job's device count, as the planner prices the layouts it returns.
    cache = TermsCache(problem, outer, count, count, job_devices=len(used))
    templates = _templates(problem, layout, cache, StageType(tp, 1.0))
    replicas = _replica_results(problem, layout, cache, templates)
    mixed = len({t.sharding for t in templates}) > 1
    iteration_ms = nonuniform_iteration_ms(
        [(t.stage_ms, r.num_microbatches) for t, r in zip(templates, layout.replicas)], layout.virtual_stages,
        [t.sync_resharded_ms if mixed else t.sync_uniform_ms for t in templates], [t.optimizer_ms for t in templates],
    )
    plan = [(t, [r.num_microbatches]) for t, r in zip(templates, layout.replicas)]
    solver = SolverResult(status="OPTIMAL", wall_time_s=round(time.monotonic() - started, 3), gap=0.0,
                          objective_ms=round(iteration_ms, 3), bound_ms=round(iteration_ms, 3),
                          candidates_total=1, candidates_solved=0)
    result = finish_plan(
        problem, tuple(replicas), used, iteration_ms, breakdown_s(cache, plan, layout.virtual_stages, iteration_ms),
        solver, micro_batch_size=layout.micro_batch_size, schedule=layout.schedule,
        virtual_stages=layout.virtual_stages, recompute=layout.recompute,
    )
    if not simulate:
        return result
    scheduled = with_schedules(replace(problem, schedules=frozenset({layout.schedule})), result, Budget.unlimited(),
                               optional_s=0.0)
    return as_fixed_layout(refuse_overflow(problem, scheduled))
