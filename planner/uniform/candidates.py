"""The outer search space of a uniform layout, with exact memory pruning and lower bounds.

A candidate fixes tp, pp, dp, micro-batch size, recompute and schedule
(1F1B, or interleaved with v chunks); the inner CP-SAT model then chooses the
layer split. Candidates are ordered by a lower bound that holds for every
split, so branch and bound can stop early without losing the optimum; a
candidate it reaches is dropped when no split fits in memory (exact: each
stage's memory is affine in its layer count).
"""

from __future__ import annotations

import itertools

from collections.abc import Iterator
from dataclasses import dataclass, replace

from cost_models.choices import ScheduleName
from cost_models.layout import ParallelShape
from cost_models.stage_costs import (
    PartSet,
    StageCostTerms,
    max_layers_fitting,
    part_costs,
    stage_cost_terms,
)
from cost_models.context_parallel import load_balanced_chunks
from cost_models.expert_parallel import expert_layouts
from cost_models.efficiency import SoftwareConfig
from cost_models.sharded_dp import node_shard_replicas, shards_every_microbatch
from planner.budget import Budget
from planner.devices import SlotInventory, nodes_per_group, slot_inventory
from planner.numbers import divisors
from planner.problem import PlanningProblem
from planner.uniform.placements import degraded_speeds_used, packed
from planner.work import Work


@dataclass(frozen=True)
class Candidate:
    """One outer choice; built cheaply for every shape, examined further only if its bound is promising."""

    terms: StageCostTerms
    inventory: SlotInventory
    lower_bound_ms: float

    @property
    def shape(self) -> ParallelShape:
        return self.terms.shape

    @property
    def replica_speeds(self) -> tuple[tuple[float, ...], ...]:
        return replica_speed_vectors(self.inventory, self.shape.pp, self.shape.dp, self.shape.expert_replicas)

    def max_layers(self, memory_bytes: float) -> tuple[int, ...]:
        """Per stage position, the most layers that fit in `memory_bytes`."""
        return tuple(max_layers_fitting(self.terms, stage, memory_bytes) for stage in range(self.shape.pp))


def tensor_parallel_sizes(problem: PlanningProblem) -> list[int]:
    """TP sizes that divide the attention heads (and KV heads, as Megatron requires) and fit in a node."""
    model = problem.workload.model
    return [
        tp
        for tp in range(1, problem.cluster.gpus_per_node + 1)
        if model.num_attention_heads % tp == 0 and model.num_kv_heads % tp == 0
    ]


def context_parallel_sizes(problem: PlanningProblem, tp: int) -> list[int]:
    """CP sizes the search tries with `tp`: 1, and with flash attention every cp up to the problem's
    `max_context_parallel` (none with sliding-window attention) that cuts the sequence into 2 cp equal chunks
    and makes a stage group that fits
    in one node or spans whole nodes the cluster has (`cost_models.context_parallel`), the latter only
    when tp divides a node (every node then holds whole CP ranks)."""
    if not problem.software.flash_attention or problem.workload.model.sliding_window is not None:
        return [1]  # sliding windows: the ring would exchange keys no query sees, which is not priced
    cluster = problem.cluster
    seq = problem.workload.seq_length
    return [
        cp for cp in range(1, problem.max_context_parallel + 1)
        if load_balanced_chunks(seq, cp, tp) and tp * cp <= cluster.total_devices
        and nodes_per_group(cluster.gpus_per_node, tp * cp) is not None
        and (tp * cp <= cluster.gpus_per_node or cluster.gpus_per_node % tp == 0)
    ]


def split_sequences_win(problem: PlanningProblem, cp: int, mbs: int) -> bool:
    """Whether every shape with `cp` ranks and micro-batch size `mbs` is matched or beaten by a shape in the
    space without CP: when cp divides mbs and mbs / cp is a size the search tries, (tp, cp, mbs, dp) loses to
    (tp, 1, mbs / cp, dp cp) on the same GPUs in the same rank order (tp, then cp, then dp is tp, then dp cp).
    Each of its replicas is one CP rank of the other's: every GPU keeps its tokens (mbs / cp whole sequences
    instead of 1 / cp of mbs of them), its attention FLOPs (a sequence's causal attention over cp load-balanced
    ranks is 1 / cp of it), its weights and state (ZeRO over dp cp either way), its pipeline sends and its
    gradient sync (dp cp ranks, the same bytes), and drops the key/value exchange; a stage's speed is the
    slowest of tp GPUs instead of tp cp, never slower, and a schedule's makespan never rises as its ops
    shorten. So leaving these shapes out loses nothing (tests/planner/test_context_parallel_search.py
    checks one such pair)."""
    return cp > 1 and mbs % cp == 0 and mbs // cp in problem.micro_batch_sizes


def replica_speed_vectors(inventory: SlotInventory, pp: int, dp: int, expert_replicas: int = 1) -> tuple[tuple[float, ...], ...]:
    """Per-position speeds of the distinct replicas when the degraded groups among the fastest dp * pp
    slots are packed into as few replicas as possible (`placements.packed`), paced by their expert-parallel
    groups: the bubble-model searches' placement; the stock search tries others (`planner.uniform.placements`)."""
    return replace(packed(degraded_speeds_used(inventory, pp, dp), pp, dp), ep=expert_replicas).distinct


@dataclass(frozen=True)
class ForcedSlow:
    """What every layout of a shape must run slowly: some replica holds at least `stages` stages at `speed` or
    below (`forced_slow`); none is (0, 1.0)."""

    stages: int = 0
    speed: float = 1.0


def forced_slow(shape: ParallelShape, inventory: SlotInventory) -> ForcedSlow:
    """A layout takes dp x pp slots, so where the full-speed ones are fewer it takes k = dp pp - full-speed
    degraded ones, none faster than the fastest degraded slot, and by pigeonhole one of its dp replicas holds
    ceil(k / dp) of them (an expert-parallel group runs at its slowest member's pace, which is no faster)."""
    forced = shape.dp * shape.pp - inventory.full_speed_count
    if forced <= 0 or not inventory.degraded:
        return ForcedSlow()
    return ForcedSlow(-(-forced // shape.dp), inventory.degraded[0].speed)


def _lower_bound_ms(terms: StageCostTerms, layers: int, *, prefix_share: float | None = None,
                    chunk_sync_overlap: bool = False, slow: ForcedSlow = ForcedSlow()) -> float:
    """A bound below every split, at full speed, plus the sync floors.

    The slowest stage takes at least the mean stage time, and at least the
    time of ceil(L / p) layers (some stage holds that many). The pipeline
    time m M + (W - M) / v grows with M for a fixed total W.

    With `prefix_share` a (0 <= a <= 1) the pipeline is instead a bound on
    every schedule's simulated makespan, when every stage s must also wait
    for a share a of the stages before it: T >= a P_s + m t_s, P_s the sum of
    t_u over u < s (`planner.schedules.bounds`: head and drain give a = 1/v
    for schedules whose backwards are whole B ops; a = 0 holds for all, a
    stage running its own m t_s one op at a time). Over real splits, the
    least max_s (a P_s + m t_s) with sum t = W has every term equal, g: then
    g / a - P_(s+1) = (g / a - P_s)(1 - a / m), so W = (g / a)(1 - (1 - a/m)^p)
    and g = a W / (1 - (1 - a/m)^p) (m W / p at a = 0). No split does better:
    were every term below g, induction on s would give P_s below the equal
    solution's, and P_p below W.

    With `slow` (`forced_slow`: in every layout of the shape some replica runs j stages at speed s < 1 or
    below), that replica's speeds v_i sum to at most p - j + j s, and a stage takes its compute c_i over its
    speed (links do not slow): max_i (c_i / v_i) >= sum_i c_i / sum_i v_i >= C / (p - j + j s), C the compute
    of one microbatch through every layer and both ends at full speed. Chunked shapes (v > 1) split the layers
    evenly, L / p a stage, in every search: a slow stage then takes at least (L / p) c_layer / s. The slowest
    replica's bubble-model pipeline (m - 1/v) M + W / v and every schedule's m M are no less with this M and
    the full-speed W.

    The sync floor is the last bucket of a stage of mean parameters, and the first bucket of its weight
    all-gather with ZeRO-1 (under the 1F1B overlap model at least the largest stage's stay exposed); with `chunk_sync_overlap` (looped BFS allowed, which
    hides finished chunks' sync: `planner.schedules.sync`) only some stage's last bucket is sure to, and
    every stage holds a layer at least.
    """
    dp_floor, optimizer_floor = _sync_floor_ms(terms, layers, chunk_sync_overlap)
    pipeline = _pipeline_floor_ms(terms, layers, *_work_ms(terms), prefix_share, _compute_ms(terms, layers), slow)
    return pipeline + dp_floor + optimizer_floor


def _compute_ms(terms: StageCostTerms, layers: int) -> tuple[float, float]:
    """(one microbatch's forward and backward compute through every layer, the embedding and the head; one
    layer's) at full speed: what a slow stage stretches (`cost_models.iteration.stage_time`)."""
    def compute(part) -> float:
        return part.time.forward_compute_ms + part.time.backward_compute_ms
    layer = compute(terms.layer)
    return layers * layer + compute(terms.embedding) + compute(terms.head), layer


def _work_ms(terms: StageCostTerms) -> tuple[float, float]:
    """(one layer's, the embedding's and head's together) forward and backward at full speed: the same for
    every shape of one `part_costs` key (and, under ZeRO-2/3, one dp)."""
    layer_ms = terms.layer.time.forward_ms + terms.layer.time.backward_ms
    return layer_ms, sum(part.time.forward_ms + part.time.backward_ms for part in (terms.embedding, terms.head))


def _pipeline_floor_ms(terms: StageCostTerms, layers: int, layer_ms: float, ends_ms: float,
                       prefix_share: float | None, compute_ms: tuple[float, float] = (0.0, 0.0),
                       slow: ForcedSlow = ForcedSlow()) -> float:
    """The pipeline term of `_lower_bound_ms`; `compute_ms` (all of a microbatch's, one layer's) is read only
    with forced `slow` stages."""
    p, m, v = terms.shape.pp, terms.num_microbatches, terms.shape.virtual_stages
    work = layers * layer_ms + ends_ms + p * terms.p2p_ms
    slowest = max(work / p, -(-layers // p) * layer_ms + terms.p2p_ms)
    if slow.stages:
        total_compute, layer_compute = compute_ms
        slowest = max(slowest, total_compute / (p - slow.stages + slow.stages * slow.speed))
        if v > 1:
            slowest = max(slowest, layers // p * layer_compute / slow.speed)
    if prefix_share is None:
        return m * slowest + (work - slowest) / v
    if prefix_share > 0:
        return max(m * slowest, prefix_share * work / (1 - (1 - prefix_share / m) ** p))
    return m * slowest


def _sync_floor_ms(terms: StageCostTerms, layers: int, chunk_sync_overlap: bool = False) -> tuple[float, float]:
    """(data-parallel sync, optimizer step) terms of `_lower_bound_ms`. They depend on tp, cp, ep, dp and pp
    alone: weights per GPU do not change with the micro-batch size or recompute, nor do the sync's ranks,
    links and bytes per weight."""
    p = terms.shape.pp
    mean_params = (layers * terms.layer.params + terms.embedding.params + terms.head.params) / p
    dp_floor = 0.0
    if terms.shape.grad_sync_ranks > 1:
        least_params = terms.layer.params if chunk_sync_overlap else mean_params
        synced = min(terms.bucket_params, least_params) if terms.overlap_grad_reduce else least_params
        gathered = min(terms.bucket_params, least_params) if terms.overlap_param_gather else least_params
        dp_floor = terms.dp_sync_ms(synced) + terms.param_gather_ms(gathered)
    return dp_floor, mean_params * terms.optimizer_ms_per_param


class LowerBounds:
    """`_lower_bound_ms` of many shapes of one problem, each of its pieces computed once for the shapes that
    share what it depends on: one layer's and the ends' work (the `part_costs` key, and under ZeRO-2/3 dp)
    and the sync floors (tp, cp, ep, dp, pp: `_sync_floor_ms`)."""

    def __init__(self, problem: PlanningProblem) -> None:
        self._layers = problem.workload.model.num_layers
        self._sharded_parts = shards_every_microbatch(problem.workload.zero_stage)  # part times depend on dp
        self._software = problem.software
        self._works: dict[tuple, tuple[float, float]] = {}
        self._computes: dict[tuple, tuple[float, float]] = {}
        self._syncs: dict[tuple, tuple[float, float]] = {}

    def bound_ms(self, terms: StageCostTerms, prefix_share: float | None = None,
                 chunk_sync_overlap: bool = False, slow: ForcedSlow = ForcedSlow()) -> float:
        """`_lower_bound_ms`; `slow` as there (`forced_slow`)."""
        shape = terms.shape
        work_key = parts_key(shape, self._software)
        if self._sharded_parts:
            work_key += (shape.dp, shape.dp_shard)
        work = self._works.get(work_key) or self._works.setdefault(work_key, _work_ms(terms))
        compute_ms = (0.0, 0.0)
        if slow.stages:
            compute_key = ("compute", *work_key)
            compute_ms = self._computes.get(compute_key) or self._computes.setdefault(
                compute_key, _compute_ms(terms, self._layers))
        sync_key = (shape.tp, shape.cp, shape.ep, shape.etp, shape.dp, shape.dp_shard, shape.pp, chunk_sync_overlap)
        dp_floor, optimizer_floor = self._syncs.get(sync_key) or self._syncs.setdefault(
            sync_key, _sync_floor_ms(terms, self._layers, chunk_sync_overlap))
        return (_pipeline_floor_ms(terms, self._layers, *work, prefix_share, compute_ms, slow)
                + dp_floor + optimizer_floor)


def simulation_floor_ms(candidate: Candidate, layers: int, *, full_backward: bool, chunk_sync_overlap: bool = False,
                        bounds: LowerBounds | None = None) -> float:
    """Below the reported (simulated) time of every split (`_lower_bound_ms` with a prefix share): 1/v when
    every allowed schedule runs whole backward ops, else 0; `chunk_sync_overlap` when a schedule that hides
    finished chunks' sync (looped BFS) is allowed for this shape. `bounds`: shared pieces, for many shapes."""
    share = 1.0 / candidate.shape.virtual_stages if full_backward else 0.0
    slow = forced_slow(candidate.shape, candidate.inventory)
    if bounds is not None:
        return bounds.bound_ms(candidate.terms, share, chunk_sync_overlap, slow)
    return _lower_bound_ms(candidate.terms, layers, prefix_share=share, chunk_sync_overlap=chunk_sync_overlap,
                           slow=slow)


def split_fits(shape: ParallelShape, max_layers: tuple[int, ...], layers: int, stock_only: bool) -> bool:
    """Whether some split of the allowed form fits the per-stage layer caps (exact)."""
    if min(max_layers) < 1:
        return False
    if shape.virtual_stages > 1:
        return all(n >= layers // shape.pp for n in max_layers)
    if stock_only and shape.pp > 3:
        middle_cap = min(min(max_layers[1:-1]), (layers - 2) // (shape.pp - 2))
        return any(
            min(max_layers[0], layers) + min(max_layers[-1], layers) + n * (shape.pp - 2) >= layers
            for n in range(1, middle_cap + 1)
        )
    return sum(min(n, layers) for n in max_layers) >= layers


def _memory_schedule(allowed: frozenset[str] | None, chunked: bool) -> str:
    """The schedule a shape's memory is sized for (its schedule names the memory model): 1F1B's or
    interleaved's in-flight count, unless every allowed schedule for that chunking holds all microbatches
    before its first backward (GPipe, looped BFS); sized for 1F1B, their runs would not fit."""
    usual, hold_all = (ScheduleName.INTERLEAVED, ScheduleName.LOOPED_BFS) if chunked else (
        ScheduleName.ONE_F_ONE_B, ScheduleName.GPIPE)
    lean = {usual, ScheduleName.OPTIMIZED} | (set() if chunked else {ScheduleName.ZB_H1, ScheduleName.ZB_H2})
    return hold_all if allowed is not None and not allowed & lean else usual


def _schedules(layers: int, pp: int, microbatches: int, max_virtual_stages: int,
               allowed: frozenset[str] | None = None) -> Iterator[tuple[str, int]]:
    yield _memory_schedule(allowed, chunked=False), 1
    if pp < 2 or microbatches % pp:
        return
    for v in range(2, max_virtual_stages + 1):
        if layers % (pp * v) == 0:
            yield _memory_schedule(allowed, chunked=True), v


def enumerate_shapes(problem: PlanningProblem) -> Iterator[tuple[ParallelShape, SlotInventory]]:
    """Every shape of the uniform space. The largest TP size (which large models need), the most
    replicas and the longest pipelines come first, so that a search whose deadline cuts this short
    has looked at the shapes that use the cluster."""
    layers = problem.workload.model.num_layers
    batch = problem.workload.global_batch_size
    modes, allowed, most_chunks = problem.recompute_modes, problem.allowed_schedules, problem.config.max_virtual_stages
    for tp in reversed(tensor_parallel_sizes(problem)):
        for cp in context_parallel_sizes(problem, tp):
            inventory = slot_inventory(problem.cluster, tp * cp)
            if inventory.total == 0:
                continue
            for mbs in problem.micro_batch_sizes:
                if batch % mbs or split_sequences_win(problem, cp, mbs):
                    continue
                for dp in reversed([d for d in divisors(batch // mbs) if d <= inventory.total]):
                    microbatches = batch // (dp * mbs)
                    experts = expert_layouts(problem.workload.model, tp, dp, problem.max_expert_parallel, cp)
                    shards = shard_group_sizes(problem, tp * cp, dp)
                    for pp in range(min(layers, inventory.total // dp), 0, -1):
                        for schedule, v in _schedules(layers, pp, microbatches, most_chunks, allowed):
                            if not problem.allows_virtual_stages(v):
                                continue
                            for recompute in modes:
                                for ep, etp in experts:
                                    for dp_shard in shards:
                                        shape = ParallelShape(tp, pp, dp, mbs, recompute, schedule, v, cp, ep,
                                                              dp_shard, etp)
                                        if shape.shard_group_holds_ep_groups:
                                            yield shape, inventory


def parts_key(shape: ParallelShape, software: SoftwareConfig) -> tuple:
    """What a shape's layer, embedding and head costs (`part_costs`) depend on: tp, cp, micro-batch size,
    recompute and the expert layout; with Megatron's EP overlap, the schedule too (the share of ops it merges)."""
    key = (shape.tp, shape.cp, shape.micro_batch_size, shape.recompute, shape.ep, shape.etp)
    if software.moe_a2a_overlap and shape.ep > 1:
        key += (shape.pp, shape.virtual_stages, shape.dp)
    return key


def shard_group_sizes(problem: PlanningProblem, group_gpus: int, dp: int) -> tuple[int | None, ...]:
    """`ParallelShape.dp_shard` choices: every replica (None) and, under ZeRO-2/3, a node's replicas (hybrid
    sharding), whose per-microbatch collectives then stay on NVLink. ZeRO-1 shards over every replica only:
    hybrid, it sends no fewer bytes across nodes (`cost_models.sharded_dp`) and holds more state, so it is
    estimated (`layout.dp_shard`) but not searched; neither are shard groups of other sizes."""
    if not (problem.allow_hybrid_sharding and shards_every_microbatch(problem.workload.zero_stage)):
        return (None,)
    node = node_shard_replicas(dp, group_gpus, problem.cluster.gpus_per_node)
    return (None,) if node is None else (None, node)


def uniform_shape_count(problem: PlanningProblem) -> int:
    """About how many shapes `enumerate_shapes` yields (interleaved variants left out), counted
    without making them: what costing them will take."""
    layers = problem.workload.model.num_layers
    batch = problem.workload.global_batch_size
    count = 0
    cluster = problem.cluster
    for tp in tensor_parallel_sizes(problem):
        for cp in context_parallel_sizes(problem, tp):
            size = tp * cp
            groups = (cluster.gpus_per_node // size * cluster.num_nodes if size <= cluster.gpus_per_node
                      else cluster.total_devices // size)
            for mbs in problem.micro_batch_sizes:
                if batch % mbs == 0 and not split_sequences_win(problem, cp, mbs):
                    count += sum(min(layers, groups // dp) * len(expert_layouts(
                                     problem.workload.model, tp, dp, problem.max_expert_parallel, cp))
                                 for dp in divisors(batch // mbs) if dp <= groups)
    return count * len(problem.recompute_modes)


def ranked_candidates(problem: PlanningProblem, budget: Budget | None = None) -> tuple[list[Candidate], bool]:
    """Shapes of the search space with their lower bounds, best bound first, and whether that is
    every shape: costing them stops at the budget's deadline (`uniform_floor_ms` bounds the rest).

    Layer, embedding and head costs depend only on (tp, micro-batch size,
    recompute), so they are computed once per triple for this search.
    """
    parts: dict[tuple[int, int, int, str], PartSet] = {}
    bounds = LowerBounds(problem)
    out: list[Candidate] = []
    complete = True
    per_check = problem.config.shapes_per_clock_check
    for count, (shape, inventory) in enumerate(enumerate_shapes(problem)):
        if budget is not None and count % per_check == 0 and count:
            budget.charge(Work.SHAPE, per_check)
            if budget.expired():
                complete = False
                break
        key = parts_key(shape, problem.software)
        if key not in parts:
            parts[key] = part_costs(problem.workload, problem.hardware, shape, problem.efficiency, problem.software)
        terms = stage_cost_terms(
            problem.workload, problem.hardware, shape, problem.efficiency, problem.software, parts[key]
        )
        out.append(Candidate(terms=terms, inventory=inventory,
                             lower_bound_ms=bounds.bound_ms(terms, slow=forced_slow(shape, inventory))))
    # Equal bounds in the ascending order of tp, cp, micro-batch size, dp, pp, chunks, recompute mode and ep,
    # expert-TP = TP before 1, full sharding before hybrid.
    modes = {mode: index for index, mode in enumerate(problem.recompute_modes)}

    def rank(candidate: Candidate) -> tuple:
        shape = candidate.terms.shape
        return (candidate.lower_bound_ms, shape.tp, shape.cp, shape.micro_batch_size, shape.dp, shape.pp,
                shape.virtual_stages, modes[shape.recompute], shape.ep, -shape.expert_tp, -shape.shard_replicas)

    out.sort(key=rank)
    if budget is not None and complete:  # the shapes since the last look at the clock, and the sort
        budget.charge(Work.SHAPE, len(out) - per_check * ((len(out) - 1) // per_check) if out else 0)
    return out, complete


def uniform_floor_ms(problem: PlanningProblem) -> float:
    """A lower bound on every uniform layout, cheap to compute: with tp, micro-batch size and
    recompute fixed, m = N / dp microbatches on p stages take at least m W / p, W one
    microbatch's forward and backward through every layer, the embedding and the head, and
    dp p is at most the TP groups the nodes can form (as `_lower_bound_ms`, minus what
    depends on the rest of the shape).

    Shapes with context parallelism need no term of their own: with cp ranks a microbatch's W on one GPU
    is at least W(cp = 1) / cp (GEMMs, attention, elementwise traffic and the head split by cp; the
    per-layer overhead and link latencies do not shrink; the key/value exchange only adds), while the
    nodes form at most 1 / cp as many groups of tp x cp GPUs as of tp: m W / (dp p) with dp p at most
    groups(tp) / cp is no less than the cp = 1 floor."""
    batch = problem.workload.global_batch_size
    layers = problem.workload.model.num_layers
    best = float("inf")
    for tp in tensor_parallel_sizes(problem):
        groups = slot_inventory(problem.cluster, tp).total
        if groups == 0:
            continue
        expert_tps = (None, 1) if problem.workload.model.is_moe and tp > 1 else (None,)
        for mbs in problem.micro_batch_sizes:
            if batch % mbs:
                continue
            for recompute, etp in itertools.product(problem.recompute_modes, expert_tps):
                # Whole experts (etp 1) run wider GEMMs without the expert-TP collectives: their work without
                # the all-to-all (ep 1 here) is below every etp 1 shape's.
                shape = ParallelShape(tp, 1, 1, mbs, recompute, etp=etp)
                parts = part_costs(problem.workload, problem.hardware, shape, problem.efficiency, problem.software)
                work = sum(part.time.forward_ms + part.time.backward_ms for part in (parts.embedding, parts.head))
                work += layers * (parts.layer.time.forward_ms + parts.layer.time.backward_ms)
                best = min(best, (batch // mbs) * work / groups)
    return best
