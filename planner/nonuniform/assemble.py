"""Concrete devices for a non-uniform layout.

Damaged nodes of a class take their partitions in node order; each
partition's blocks take the node's healthy GPUs fastest first. Base groups
come from healthy nodes in node order, then from damaged nodes. Within a
template, base groups are dealt stage-major across its replicas (Megatron's
order), so a single-template layout places data-parallel peers as the
uniform cost model assumes.
"""

from __future__ import annotations

from dataclasses import replace

from cost_models.device import device_id
from cost_models.hardware import GIB
from cost_models.pipeline import pipeline_time_ms
from planner.nonuniform.partitions import StageType
from planner.nonuniform.search import NonUniformLayout, evaluate_layout
from planner.nonuniform.templates import Template, TermsCache, stage_timings, template_costs
from planner.problem import PlanningProblem
from planner.result import ReplicaResult, StageResult, stage_schedule_fields

Group = tuple[int, tuple[int, ...]]  # node, GPUs


def recost(problem: PlanningProblem, layout: NonUniformLayout) -> NonUniformLayout:
    """The chosen layout costed with its actual replica count (sync, ZeRO memory, optimizer),
    which is never more than the search's conservative figures.

    A layout whose every replica is a single stage has no pipeline to interleave: the v chunks its outer
    choice names would run back to back on one GPU, as fast as one chunk and holding more activations,
    and no trainer runs chunks without pipeline stages (Megatron-LM and torchtitan refuse them). It is
    costed and reported as what runs, one chunk, unless the request allows chunked schedules only."""
    used = [t for t, count in zip(layout.templates, layout.allocation.replicas_per_template) if count]
    if (layout.outer.virtual_stages > 1 and problem.allows_virtual_stages(1)
            and all(len(t.stage_types) == 1 for t in used)):
        layout = replace(layout, outer=replace(layout.outer, virtual_stages=1))
    replicas = sum(layout.allocation.replicas_per_template)
    devices = layout.outer.cp * sum(count * sum(st.tp for st in t.stage_types)
                  for t, count in zip(layout.templates, layout.allocation.replicas_per_template))
    cache = TermsCache(problem, layout.outer, replicas, layout.link_replicas, job_devices=devices)
    base = StageType(layout.outer.tp, 1.0)
    templates = tuple(template_costs(problem, cache, t.stage_types, t.layers_per_stage, base, replicas) for t in layout.templates)
    value = evaluate_layout(templates, layout.allocation, layout.outer.virtual_stages)
    return replace(layout, templates=templates, iteration_ms=value, memory_replicas=replicas, job_devices=devices)


def _group_pools(problem: PlanningProblem, layout: NonUniformLayout) -> dict[StageType, list[Group]]:
    cluster = problem.cluster
    base = StageType(layout.outer.tp, 1.0)
    pools: dict[StageType, list[Group]] = {base: []}
    damaged = cluster.damaged_nodes
    group = layout.outer.tp * layout.outer.cp
    per_node = cluster.gpus_per_node // group
    for node in range(cluster.num_nodes):
        if node not in damaged:
            pools[base].extend((node, tuple(range(g * group, (g + 1) * group))) for g in range(per_node))
    for node_class, partitions, counts in zip(layout.classes, layout.partitions, layout.allocation.partition_counts):
        nodes = iter(node_class.nodes)
        for partition, count in zip(partitions, counts):
            for _ in range(count):
                node = next(nodes)
                healthy = [g for g, _ in cluster.healthy_by_speed[node]]
                offset = 0
                for stage_type in partition.groups:
                    size = stage_type.tp * layout.outer.cp
                    members = tuple(sorted(healthy[offset : offset + size]))
                    pools.setdefault(stage_type, []).append((node, members))
                    offset += size
    return pools


def assemble_replicas(problem: PlanningProblem, layout: NonUniformLayout) -> tuple[list[ReplicaResult], set[tuple[int, int]]]:
    pools = _group_pools(problem, layout)
    cursor = {stage_type: 0 for stage_type in pools}

    def take(stage_type: StageType) -> Group:
        group = pools[stage_type][cursor[stage_type]]
        cursor[stage_type] += 1
        return group

    replicas: list[ReplicaResult] = []
    used: set[tuple[int, int]] = set()
    cache = layout.terms_cache(problem)
    for template, microbatches in layout.replica_plan():
        timings = stage_timings(cache, template)
        count = len(microbatches)
        grid: list[list[Group | None]] = [[None] * len(template.stage_types) for _ in range(count)]
        base = StageType(layout.outer.tp, 1.0)
        for r in range(count):
            for i, stage_type in enumerate(template.stage_types):
                if stage_type != base:
                    grid[r][i] = take(stage_type)
        for i, stage_type in enumerate(template.stage_types):
            if stage_type == base:
                for r in range(count):
                    grid[r][i] = take(base)
        for r in range(count):
            stages = []
            first = 0
            for i, (stage_type, layers) in enumerate(zip(template.stage_types, template.layers_per_stage)):
                node, gpus = grid[r][i]
                used.update((node, g) for g in gpus)
                stages.append(StageResult(
                    id=i,
                    layers=(first, first + layers),
                    devices=tuple(device_id(node, g) for g in gpus),
                    tp=stage_type.tp,
                    cp=layout.outer.cp,
                    memory_gib=round(timings[i].memory_bytes / GIB, 3),
                    forward_ms=round(timings[i].forward_ms, 3),
                    backward_ms=round(timings[i].backward_ms, 3),
                    speed=stage_type.speed,
                    **stage_schedule_fields(timings[i]),
                ))
                first += layers
            replicas.append(ReplicaResult(id=len(replicas), num_microbatches=microbatches[r], stages=tuple(stages)))
    return replicas, used


def breakdown_s(cache: TermsCache, replica_plan: list[tuple[Template, list[int]]], virtual_stages: int,
                iteration_ms: float) -> dict[str, float]:
    """Seconds on the slowest replica's bottleneck stage; the parts sum to the iteration.
    `replica_plan`: per template used, its replicas' microbatches."""
    v = virtual_stages
    template, microbatches = max(replica_plan, key=lambda item: pipeline_time_ms(item[0].stage_ms, max(item[1]), v))
    m = max(microbatches)
    pipeline = pipeline_time_ms(template.stage_ms, m, v)
    k = max(range(len(template.stage_ms)), key=lambda i: template.stage_ms[i])
    stage = stage_timings(cache, template)[k]
    sync_and_step = iteration_ms - pipeline
    optimizer = max(t.optimizer_ms for t, _ in replica_plan)
    return {
        "compute_s": m * stage.compute_ms / 1e3,
        "tp_comm_s": m * stage.tp_comm_ms / 1e3,
        "pp_comm_s": m * stage.p2p_ms / 1e3,
        "pipeline_bubble_s": (pipeline - m * stage.total_ms) / 1e3,
        "dp_comm_s": (sync_and_step - optimizer + m * stage.shard_comm_ms) / 1e3,
        "optimizer_s": optimizer / 1e3,
        "cp_comm_s": m * stage.cp_comm_ms / 1e3,
        "ep_comm_s": m * stage.ep_comm_ms / 1e3,
    }
