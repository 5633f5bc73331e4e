"""One fixed layout, no search: "how fast is the configuration I run today?"."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from cost_models.choices import Recompute, ScheduleName
from cost_models.hardware import GIB
from cost_models.layout import ParallelShape
from cost_models.stage_costs import stage_cost_terms, stage_memory_bytes
from planner.assemble import assemble_plan
from planner.budget import Budget
from planner.devices import slot_inventory
from planner.errors import InfeasibleError, PlanningError
from planner.problem import PlanningProblem
from planner.reported import as_fixed_layout
from planner.result import PlanResult
from planner.schedules.for_plan import with_schedules
from planner.schedules.handcrafted import CHUNKED_NAMES
from planner.uniform.candidates import Candidate
from planner.uniform.search import SearchResult, evaluate


@dataclass(frozen=True)
class FixedLayout:
    """A layout as a user states it. dp None: as many replicas as the healthy devices hold."""

    tp: int
    pp: int
    micro_batch_size: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    recompute: str = Recompute.SELECTIVE
    layers_per_stage: tuple[int, ...] | None = None
    dp: int | None = None


def _check_layout(problem: PlanningProblem, layout: FixedLayout) -> tuple[int, tuple[int, ...]]:
    """(dp, layer split), or PlanningError saying what is wrong."""
    model = problem.workload.model
    cluster = problem.cluster
    layers = model.num_layers
    if layout.tp > cluster.gpus_per_node:
        raise PlanningError(f"tp {layout.tp} exceeds gpus_per_node {cluster.gpus_per_node}: a TP group must fit in one node")
    if model.num_attention_heads % layout.tp or model.num_kv_heads % layout.tp:
        raise PlanningError(
            f"tp {layout.tp} must divide the {model.num_attention_heads} attention heads and {model.num_kv_heads} KV heads"
        )
    chunked = layout.schedule in CHUNKED_NAMES
    if not chunked and layout.virtual_stages != 1:
        raise PlanningError(f"schedule {layout.schedule} runs one model chunk per stage: set virtual_stages to 1 or "
                            f"use {' or '.join(CHUNKED_NAMES)}")
    if chunked and (layout.virtual_stages < 2 or layout.pp < 2):
        raise PlanningError(f"the {layout.schedule} schedule needs pp >= 2 and virtual_stages >= 2")
    if layout.pp > layers:
        raise PlanningError(f"pp {layout.pp} exceeds the model's {layers} layers")
    if layout.layers_per_stage is not None:
        split = tuple(layout.layers_per_stage)
        if len(split) != layout.pp or min(split) < 1 or sum(split) != layers:
            raise PlanningError(
                f"layers_per_stage {list(split)} must list pp={layout.pp} positive counts summing to num_layers={layers}"
            )
        if layout.virtual_stages > 1 and len(set(split)) != 1:
            raise PlanningError("the interleaved schedule needs equal layers per stage")
    else:
        if layers % layout.pp:
            raise PlanningError(
                f"pp {layout.pp} does not divide num_layers {layers}; give layers_per_stage for an uneven split"
            )
        split = (layers // layout.pp,) * layout.pp
    if layout.virtual_stages > 1 and (layers // layout.pp) % layout.virtual_stages:
        raise PlanningError(
            f"{layers // layout.pp} layers per stage cannot be cut into virtual_stages={layout.virtual_stages} equal chunks"
        )
    slots = slot_inventory(cluster, layout.tp).total
    max_dp = slots // layout.pp
    if max_dp < 1:
        raise PlanningError(
            f"tp {layout.tp} x pp {layout.pp} needs {layout.pp} TP groups of {layout.tp} healthy GPUs; the cluster has {slots}"
        )
    dp = layout.dp if layout.dp is not None else max_dp
    if dp > max_dp:
        raise PlanningError(f"dp {dp} needs {dp * layout.pp} TP groups of {layout.tp} healthy GPUs; the cluster has {slots}")
    batch = problem.workload.global_batch_size
    if layout.dp is None:
        while dp > 1 and batch % (dp * layout.micro_batch_size):
            dp -= 1
    if batch % (dp * layout.micro_batch_size):
        raise PlanningError(
            f"global_batch_size {batch} is not divisible by dp {dp} x micro_batch_size {layout.micro_batch_size}"
        )
    microbatches = batch // (dp * layout.micro_batch_size)
    if layout.schedule == ScheduleName.INTERLEAVED and microbatches % layout.pp:
        raise PlanningError(
            f"the interleaved schedule needs the {microbatches} microbatches per replica to be a multiple of pp {layout.pp}"
        )
    return dp, split


def estimate_layout(problem: PlanningProblem, layout: FixedLayout) -> PlanResult:
    started = time.monotonic()
    dp, split = _check_layout(problem, layout)
    shape = ParallelShape(
        layout.tp, layout.pp, dp, layout.micro_batch_size, layout.recompute, layout.schedule, layout.virtual_stages
    )
    terms = stage_cost_terms(problem.workload, problem.hardware, shape, problem.efficiency, problem.software)
    capacity = problem.hardware.gpu.memory_bytes
    for stage, count in enumerate(split):
        need = stage_memory_bytes(terms, stage, count)
        if need > capacity:
            raise InfeasibleError(
                f"stage {stage} ({count} layers, tp={layout.tp}, micro_batch_size={layout.micro_batch_size}, "
                f"recompute={layout.recompute}) needs {need / GIB:.1f} GiB per GPU; a {problem.hardware.gpu.name} "
                f"holds {problem.hardware.gpu.memory_gib:.0f} GiB"
            )
    candidate = Candidate(terms=terms, inventory=slot_inventory(problem.cluster, layout.tp), lower_bound_ms=0.0)
    estimate = evaluate(candidate, split)
    found = SearchResult(
        candidate=candidate,
        layers_per_stage=split,
        estimate=estimate,
        objective_ms=estimate.iteration_ms,
        bound_ms=estimate.iteration_ms,
        optimal=True,
        wall_time_s=time.monotonic() - started,
        candidates_total=1,
        candidates_solved=0,
    )
    # The layout names its schedule: simulate exactly that one, no search.
    allowed = frozenset({layout.schedule})
    result = with_schedules(replace(problem, schedules=allowed), assemble_plan(problem, found), Budget.unlimited(),
                            optional_s=0.0)
    return as_fixed_layout(refuse_overflow(problem, result))


def refuse_overflow(problem: PlanningProblem, result: PlanResult) -> PlanResult:
    """`result`, unless its schedule keeps more activations in flight than some stage's GPUs hold: then
    the layout does not run as given (the memory check before scheduling assumes 1F1B's in-flight count)."""
    capacity_gib = problem.hardware.gpu.memory_gib
    for replica in result.replicas:
        for stage in replica.stages:
            # Stage figures are rounded to 1e-3 GiB.
            if stage.memory_gib > capacity_gib + 1e-3:
                raise InfeasibleError(
                    f"replica {replica.id} stage {stage.id}: the {result.schedule} schedule keeps "
                    f"{stage.memory_gib - stage.static_memory_gib:.2f} GiB of activations in flight beside "
                    f"{stage.static_memory_gib:.2f} GiB of weights and state, {stage.memory_gib:.2f} GiB per GPU; a "
                    f"{problem.hardware.gpu.name} holds {capacity_gib:.0f} GiB. A schedule with fewer microbatches in "
                    "flight (1f1b), a smaller micro_batch_size or recompute fits better"
                )
    return result
