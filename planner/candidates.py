"""The outer search space of a uniform layout, with exact memory pruning and lower bounds.

A candidate fixes tp, pp, dp, micro-batch size, recompute and schedule
(1F1B, or interleaved with v chunks); the inner CP-SAT model then chooses the
layer split. Candidates are pruned when no split fits in memory (exact: each
stage's memory is affine in its layer count) and ordered by a lower bound
that holds for every split, so branch and bound can stop early without
losing the optimum.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from cost_models.layout import ParallelShape
from cost_models.stage_costs import StageCostTerms, max_layers_fitting, stage_cost_terms
from planner.devices import SlotInventory, slot_inventory
from planner.problem import MAX_VIRTUAL_STAGES, PlanningProblem


@dataclass(frozen=True)
class Candidate:
    terms: StageCostTerms
    replica_speeds: tuple[tuple[float, ...], ...]  # distinct per-position speed vectors in use
    max_layers: tuple[int, ...]  # per stage position, from memory
    lower_bound_ms: float

    @property
    def shape(self) -> ParallelShape:
        return self.terms.shape


def tensor_parallel_sizes(problem: PlanningProblem) -> list[int]:
    """TP sizes that divide the attention heads (and KV heads, as Megatron requires) and fit in a node."""
    model = problem.workload.model
    return [
        tp
        for tp in range(1, problem.cluster.gpus_per_node + 1)
        if model.num_attention_heads % tp == 0 and model.num_kv_heads % tp == 0
    ]


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def replica_speed_vectors(inventory: SlotInventory, pp: int, dp: int) -> tuple[tuple[float, ...], ...]:
    """Per-position speeds of the replicas that hold degraded slots (plus one healthy one if any).

    The fastest dp * pp slots are used; degraded ones are packed into as few
    replicas as possible, in middle positions first (the ends carry the
    embedding and the head).
    """
    speeds = inventory.speeds_of_first(pp * dp)
    slow = sorted((s for s in speeds if s < 1.0))
    positions = list(range(1, pp - 1)) + ([0, pp - 1] if pp > 1 else [0])
    vectors: list[tuple[float, ...]] = []
    while slow:
        vector = [1.0] * pp
        for position in positions:
            if not slow:
                break
            vector[position] = slow.pop(0)
        vectors.append(tuple(vector))
    if len(vectors) < dp:
        vectors.append(tuple([1.0] * pp))
    return tuple(dict.fromkeys(vectors))


def _lower_bound_ms(terms: StageCostTerms, layers: int) -> float:
    """A bound below every split: the balanced continuous pipeline at full speed, plus the sync floors."""
    p, m, v = terms.shape.pp, terms.num_microbatches, terms.shape.virtual_stages
    layer_ms = terms.layer.time.forward_ms + terms.layer.time.backward_ms
    ends_ms = sum(part.time.forward_ms + part.time.backward_ms for part in (terms.embedding, terms.head))
    work = layers * layer_ms + ends_ms + p * terms.p2p_ms
    pipeline = m * work / p + work * (p - 1) / (p * v)
    mean_params = (layers * terms.layer.params + terms.embedding.params + terms.head.params) / p
    dp_floor = 0.0
    if terms.shape.dp > 1:
        synced = min(terms.bucket_params, mean_params) if terms.overlap_grad_reduce else mean_params
        dp_floor = terms.dp_sync_ms(synced)
    return pipeline + dp_floor + mean_params * terms.optimizer_ms_per_param


def _split_fits(shape: ParallelShape, max_layers: tuple[int, ...], layers: int, stock_only: bool) -> bool:
    if min(max_layers) < 1:
        return False
    if shape.virtual_stages > 1:
        return all(n >= layers // shape.pp for n in max_layers)
    if stock_only and shape.pp > 2:
        middle = min(max_layers[1:-1])
        best_middle = min(middle, (layers - 2) // (shape.pp - 2))
        return any(
            max_layers[0] + max_layers[-1] + n * (shape.pp - 2) >= layers for n in range(1, best_middle + 1)
        )
    return sum(min(n, layers) for n in max_layers) >= layers


def _schedules(layers: int, pp: int, microbatches: int) -> Iterator[tuple[str, int]]:
    yield "1f1b", 1
    if pp < 2 or microbatches % pp:
        return
    for v in range(2, MAX_VIRTUAL_STAGES + 1):
        if layers % (pp * v) == 0:
            yield "interleaved", v


def enumerate_shapes(problem: PlanningProblem) -> Iterator[tuple[ParallelShape, SlotInventory]]:
    layers = problem.workload.model.num_layers
    batch = problem.workload.global_batch_size
    for tp in tensor_parallel_sizes(problem):
        inventory = slot_inventory(problem.cluster, tp)
        if inventory.total == 0:
            continue
        for mbs in problem.micro_batch_sizes:
            if batch % mbs:
                continue
            for dp in _divisors(batch // mbs):
                if dp > inventory.total:
                    break
                microbatches = batch // (dp * mbs)
                for pp in range(1, min(layers, inventory.total // dp) + 1):
                    for schedule, v in _schedules(layers, pp, microbatches):
                        for recompute in problem.recompute_modes:
                            yield ParallelShape(tp, pp, dp, mbs, recompute, schedule, v), inventory


def feasible_candidates(problem: PlanningProblem) -> tuple[list[Candidate], int]:
    """Memory-feasible candidates sorted by lower bound, and how many shapes were enumerated."""
    layers = problem.workload.model.num_layers
    capacity = problem.hardware.gpu.memory_bytes
    out: list[Candidate] = []
    total = 0
    for shape, inventory in enumerate_shapes(problem):
        total += 1
        terms = stage_cost_terms(problem.workload, problem.hardware, shape, problem.efficiency, problem.software)
        max_layers = tuple(max_layers_fitting(terms, stage, capacity) for stage in range(shape.pp))
        if not _split_fits(shape, max_layers, layers, problem.stock_layouts_only):
            continue
        out.append(Candidate(
            terms=terms,
            replica_speeds=replica_speed_vectors(inventory, shape.pp, shape.dp),
            max_layers=max_layers,
            lower_bound_ms=_lower_bound_ms(terms, layers),
        ))
    out.sort(key=lambda c: c.lower_bound_ms)
    return out, total


