"""Why nothing fits, in the user's terms and with the numbers."""

from __future__ import annotations

from dataclasses import replace

from cost_models.choices import Recompute, ScheduleName
from cost_models.hardware import GIB
from cost_models.expert_parallel import expert_layouts
from cost_models.layout import ParallelShape
from cost_models.memory import WEIGHT_BYTES_PER_PARAM, optimizer_bytes_per_param
from cost_models.stage_costs import stage_cost_terms, stage_memory_bytes
from planner.devices import slot_inventory
from planner.problem import PlanningProblem
from planner.uniform.candidates import tensor_parallel_sizes


# Schedules that run every forward before the first backward, so hold all microbatches at once.
HOLD_ALL_SCHEDULES = frozenset({ScheduleName.GPIPE, ScheduleName.LOOPED_BFS})


def format_bytes(value: float) -> str:
    if value >= 1024 * GIB:
        return f"{value / (1024 * GIB):.1f} TiB"
    return f"{value / GIB:.0f} GiB"


def _leanest_layout(problem: PlanningProblem) -> tuple[float, ParallelShape] | None:
    """The layout needing the least memory on its fullest GPU: most stages, mbs 1, full recompute, and with
    ZeRO as many replicas as the GPUs hold (each shards more of the state)."""
    layers = problem.workload.model.num_layers
    best: tuple[float, ParallelShape] | None = None
    for tp in tensor_parallel_sizes(problem):
        slots = slot_inventory(problem.cluster, tp).total
        if slots == 0:
            continue
        pp = min(layers, slots)
        dp = max(1, slots // pp) if problem.workload.zero_stage >= 1 else 1
        recompute = Recompute.FULL if Recompute.FULL in problem.recompute_modes else problem.recompute_modes[0]
        # A mixture of experts splits its experts over the most replicas it may (or none: see expert_parallel)
        experts = expert_layouts(problem.workload.model, tp, max(1, slots // pp), problem.max_expert_parallel)
        # Memory depends on ep x etp alone: the layout splitting the experts most needs no other.
        widest = max(experts, key=lambda pair: pair[0] * (tp if pair[1] is None else pair[1]))
        for ep, etp in dict.fromkeys([(1, None), widest]):
            shape = ParallelShape(tp, pp, 1, 1, recompute, ep=ep, etp=etp)
            shape = replace(shape, dp=max(dp, shape.expert_replicas))
            terms = stage_cost_terms(problem.workload, problem.hardware, shape, problem.efficiency, problem.software)
            base, extra = divmod(layers, pp)
            need = max(stage_memory_bytes(terms, i, base + (1 if i < extra else 0)) for i in range(pp))
            if best is None or need < best[0]:
                best = (need, shape)
    return best


def obvious_infeasibility(problem: PlanningProblem) -> str | None:
    """Why no layout can exist, when that is plain without searching (else None)."""
    cluster = problem.cluster
    model = problem.workload.model
    gpu = problem.hardware.gpu
    surviving = cluster.total_devices - len(cluster.failed)
    if surviving == 0:
        return f"all {cluster.total_devices} GPUs are listed as failed; nothing is left to train on"
    tps = tensor_parallel_sizes(problem)
    usable = [tp for tp in tps if slot_inventory(cluster, tp).total > 0]
    if not usable:
        return (
            f"no tensor-parallel size fits: sizes dividing {model.num_attention_heads} attention heads and "
            f"{model.num_kv_heads} KV heads are {tps}, but no node has that many healthy GPUs"
        )
    state_bytes = (WEIGHT_BYTES_PER_PARAM + problem.software.grad_bytes
                   + optimizer_bytes_per_param(problem.software.master_weights))
    state = model.total_params * state_bytes
    capacity = surviving * problem.usable_memory_bytes
    if state > capacity:
        return (
            f"{problem.model_name} needs at least {format_bytes(state)} for weights, gradients and optimizer state "
            f"({model.total_params / 1e9:.1f}B parameters x {state_bytes:g} bytes); the {surviving} surviving {gpu.name} GPUs "
            f"hold {format_bytes(capacity)} after the {problem.memory_reserve_gib:g} GiB memory reserve each"
        )
    return None


def explain_infeasible(problem: PlanningProblem) -> str:
    obvious = obvious_infeasibility(problem)
    if obvious is not None:
        return obvious
    cluster = problem.cluster
    gpu = problem.hardware.gpu
    surviving = cluster.total_devices - len(cluster.failed)
    leanest = _leanest_layout(problem)
    if leanest is not None:
        need, shape = leanest
        if need > problem.usable_memory_bytes:
            return (
                f"no layout fits in memory: even the leanest (tp={shape.tp}, pp={shape.pp}, dp={shape.dp}, "
                f"{f'ep={shape.ep}, ' if shape.ep > 1 else ''}{f'etp={shape.etp}, ' if shape.etp is not None else ''}"
                f"zero_stage={problem.workload.zero_stage}, micro_batch_size=1, "
                f"recompute={shape.recompute}) needs {need / GIB:.1f} GiB on its fullest GPU, and "
                f"{problem.capacity_text()} at seq_length {problem.workload.seq_length}"
            )
    batch = problem.workload.global_batch_size
    sizes = problem.micro_batch_sizes
    allowed = problem.allowed_schedules
    if allowed is not None and allowed <= HOLD_ALL_SCHEDULES:
        return (
            f"no layout fits in memory with the allowed schedules {sorted(allowed)}: they keep every microbatch's "
            f"activations until the first backward, and none of the layouts on {surviving} surviving GPUs holds "
            f"its share of global_batch_size {batch} that way; allow 1f1b or interleaved, or lower the batch"
        )
    return (
        f"no layout fits: global_batch_size {batch} cannot be split into micro-batches of {list(sizes)} "
        f"over the replicas that fit in memory on {surviving} surviving GPUs"
    )
