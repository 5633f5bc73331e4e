"""ResiHP-style progressive adaptation, TP -> PP -> DP, from resiplan's healthy-cluster layout.

Start: the uniform layout resiplan picks for the cluster without failures
(tp, pp, dp, micro-batch size, recompute, schedule, chunks and the concrete
TP groups of every replica).

1. TP: a group holding a failed or slow GPU shrinks to the power-of-two
   subset of its surviving GPUs maximizing k x min(speed) (the k fastest;
   ties to the larger k; k must also be a TP size the model's heads allow).
   With nothing usable left, its replica loses the stage and is dropped.
2. PP: a replica with a degraded stage re-splits its layers speed-aware:
   `planner.nonuniform.templates.build_template` (per-stage per-layer and fixed times
   and memory caps, `best_split`: least bottleneck, then least sum), stages
   keeping their positions, the degraded one at its own tp and speed. A
   replica whose split does not fit is dropped. Untouched replicas keep the
   healthy split; should it no longer fit memory (ZeRO-1 shards the optimizer
   state over fewer replicas once some are dropped) they are re-split too.
3. DP: the global batch's microbatches go to the replicas greedily, each to
   the replica finishing earliest with it (`common.allocate_microbatches`,
   optimal for the slowest replica's pipeline time).

Iteration: slowest replica's pipeline + exposed gradient sync (resharded once
replicas differ) + optimizer step, from `planner.nonuniform.templates.template_costs`.
Memory and ZeRO-1 optimizer shares use the number of surviving replicas.
"""

from __future__ import annotations

from benchmarks.baselines.common import (
    BaselineResult,
    HealthyLayout,
    allocate_microbatches,
    fits_memory,
    healthy_plan,
    iteration_ms,
    make_result,
    read_layout,
)
from planner.errors import InfeasibleError
from planner.nonuniform.partitions import StageType
from planner.nonuniform.templates import (
    Template,
    TermsCache,
    build_template,
    template_costs,
)
from planner.problem import ClusterState, PlanningProblem
from planner.result import PlanResult
from planner.uniform.candidates import tensor_parallel_sizes

NAME = "resihp"


def shrink_group(
    cluster: ClusterState, devices: tuple[tuple[int, int], ...], sizes: list[int]
) -> StageType | None:
    """The TP step for one group: its new (tp, speed), or None if no usable subset remains."""
    alive = [d for d in devices if d not in cluster.failed]
    speeds = sorted((cluster.speed_of(*d) for d in alive), reverse=True)
    if len(alive) == len(devices) and min(speeds) >= 1.0:
        return StageType(len(devices), 1.0)
    best: tuple[float, int] | None = None
    for k in sizes:
        if k & (k - 1) or k > len(alive) or k > len(devices):
            continue
        candidate = (k * speeds[k - 1], k)  # larger product first, then larger k
        if best is None or candidate > best:
            best = candidate
    if best is None:
        return None
    k = best[1]
    return StageType(k, speeds[k - 1])


def _templates(
    problem: PlanningProblem, layout: HealthyLayout, replicas: list[tuple[StageType, ...]]
) -> list[Template | None]:
    """One template per replica (None: dropped) for this many surviving replicas."""
    count = len(replicas)
    cache = TermsCache(problem, layout.outer, count)
    base = StageType(layout.tp, 1.0)
    built: dict[tuple[StageType, ...], Template | None] = {}
    out: list[Template | None] = []
    for stage_types in replicas:
        if stage_types not in built:
            template = None
            if all(st == base for st in stage_types):
                kept = template_costs(problem, cache, stage_types, layout.layers_per_stage, base, count)
                template = kept if fits_memory(problem, cache, kept) else None
            if template is None:
                template = build_template(problem, layout.outer, cache, stage_types, base, count)
            built[stage_types] = template
        out.append(built[stage_types])
    return out


def _adapt(
    problem: PlanningProblem, layout: HealthyLayout, replicas: list[tuple[StageType, ...]], lost: int
) -> tuple[float, list[Template], list[int], int]:
    """PP and DP steps for these replicas: (iteration ms, templates, microbatches, replicas dropped)."""
    # PP: re-split damaged replicas; drop those that do not fit, until the survivors are stable.
    dropped = 0
    while True:
        if not replicas:
            raise InfeasibleError(f"resihp: no replica of the healthy layout survives ({lost} lost a stage)")
        built = _templates(problem, layout, replicas)
        keep = [r for r, t in zip(replicas, built) if t is not None]
        if len(keep) == len(replicas):
            break
        dropped += len(replicas) - len(keep)
        replicas = keep
    templates = [t for t in built if t is not None]

    # DP: microbatches to the replicas that finish earliest.
    v = layout.outer.virtual_stages
    total = problem.workload.global_batch_size // layout.outer.micro_batch_size
    microbatches = allocate_microbatches([t.stage_ms for t in templates], total, v)
    return iteration_ms(templates, microbatches, v), templates, microbatches, dropped


def run(problem: PlanningProblem, healthy: PlanResult | None = None) -> BaselineResult:
    """`healthy`: resiplan's plan for the cluster without failures (computed when not given)."""
    layout = read_layout(healthy if healthy is not None else healthy_plan(problem))
    cluster = problem.cluster
    sizes = tensor_parallel_sizes(problem)

    # TP: shrink every damaged group; a replica with an unusable group loses that stage.
    replicas: list[tuple[StageType, ...]] = []
    shrunk = lost = 0
    for groups in layout.groups:
        types = [shrink_group(cluster, devices, sizes) for devices in groups]
        if any(t is None for t in types):
            lost += 1
            continue
        shrunk += sum(1 for t, devices in zip(types, groups) if t.tp < len(devices))
        replicas.append(tuple(types))

    value, templates, microbatches, dropped = _adapt(problem, layout, replicas, lost)
    # A replica the DP step leaves idle still shards the optimizer state and, when it is
    # sharded differently, forces the resharded sync: also try without idle replicas.
    while 0 in microbatches:
        busy = [t.stage_types for t, m in zip(templates, microbatches) if m > 0]
        retry = _adapt(problem, layout, busy, lost)
        if retry[0] >= value:
            break
        idle = len(templates) - len(busy)
        value, templates, microbatches, dropped = retry[0], retry[1], retry[2], dropped + idle + retry[3]

    v = layout.outer.virtual_stages
    base = StageType(layout.tp, 1.0)
    resplit = sum(1 for t in templates if any(st != base for st in t.stage_types))
    gpus = sum(st.tp for t in templates for st in t.stage_types)
    description = (
        f"tp={layout.tp} pp={layout.pp} dp={len(templates)}/{layout.dp} mbs={layout.outer.micro_batch_size} "
        f"v={v} {layout.outer.recompute}; {shrunk} TP groups shrunk, {resplit} replicas re-split, "
        f"{lost + dropped} dropped; microbatches {min(microbatches)}..{max(microbatches)}"
    )
    return make_result(problem, NAME, value, gpus, description)
