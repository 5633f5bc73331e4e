"""Replica templates: a sequence of stage types, its layer split and its costs.

A template is a pipeline of one of three kinds: base groups only (pp down to
pp - max(2, pp // 4) stages); base groups with one degraded stage (a group of
lower TP or slower than the healthy base group) in a middle position (the
ends carry the embedding and the head); or every stage the same degraded type
(a pipeline built from damaged nodes' groups alone). The last two have
pp - 2 .. pp stages.

Its layer split minimizes the bottleneck stage time, then the sum of stage
times (what the pipeline pays per microbatch, then in fill and drain), under
each stage's memory cap. Stage i takes n_i layers at a_i per layer plus b_i
fixed, so the smallest feasible bottleneck M is the least M with
sum_i min(cap_i, floor((M - b_i) / a_i)) >= L; given M, the sum is smallest
when the remaining layers go to the stages with the smallest a_i first.
Both steps are exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property

from cost_models.choices import ScheduleName
from cost_models.compute import LayerTime
from cost_models.iteration import (
    StageTime,
    stage_backward_ms,
    stage_forward_ms,
    stage_time,
    stage_weight_grad_ms,
    stage_total_ms,
)
from cost_models.layout import ParallelShape
from cost_models.resharding import exposed_sync_ms, resharded_sync_ms
from cost_models.stage_costs import (
    PartSet,
    StageCostTerms,
    layer_caps_outline,
    max_layers_fitting_all,
    part_costs,
    pipeline_p2p_ms,
    stage_cost_terms,
)
from planner.config import DEFAULT_CONFIG, TIME_QUANTUM_MS, PlannerConfig
from planner.nonuniform.layer_splits import best_split
from planner.nonuniform.partitions import StageType
from planner.problem import PlanningProblem


def pipeline_lengths(pp: int, config: PlannerConfig = DEFAULT_CONFIG) -> range:
    """Stage counts a replica may have under nominal `pp`: base-only pipelines as short as
    pp - max(2, min(pp // 4, 6)) (so replicas of whole healthy groups can mix lengths, as
    Oobleck's templates do); templates with degraded stages pp - 2 .. pp (`config`'s lengths)."""
    return range(max(1, pp - max(config.shorter_pipelines, min(pp // 4, config.mixed_lengths))), pp + 1)


def degraded_lengths(pp: int, config: PlannerConfig = DEFAULT_CONFIG) -> range:
    return range(max(1, pp - config.shorter_pipelines), pp + 1)


@dataclass(frozen=True)
class OuterChoice:
    """What every replica shares: base TP size, nominal stage count, micro-batch size, recompute, chunks, and
    context-parallel ranks: every stage of the layout, base or degraded, runs on tp x cp GPUs of one node (a
    degraded one on fewer TP ranks, never fewer CP ranks), each sequence split over its cp ranks."""

    tp: int
    pp: int
    micro_batch_size: int
    recompute: str
    virtual_stages: int = 1
    cp: int = 1


@dataclass(frozen=True)
class Template:
    stage_types: tuple[StageType, ...]
    layers_per_stage: tuple[int, ...]
    stage_ms: tuple[float, ...]  # forward + backward per microbatch, at each stage's speed
    params_per_gpu: tuple[float, ...]
    bottleneck_ms: float
    total_ms: float
    sync_uniform_ms: float  # exposed, when every replica has this template
    sync_resharded_ms: float  # exposed, when replicas differ
    optimizer_ms: float
    base_groups: int
    degraded: tuple[tuple[StageType, int], ...]
    # Per stage and microbatch at full speed, below the same at any speed (`floor_pieces`): forward,
    # backward, and the weight-gradient part of the backward.
    forward_floor_ms: tuple[float, ...] = ()
    backward_floor_ms: tuple[float, ...] = ()
    weight_grad_floor_ms: tuple[float, ...] = ()

    @property
    def sharding(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """TP per stage and layer split: replicas alike in these need no resharding to sync."""
        return tuple(st.tp for st in self.stage_types), self.layers_per_stage

    @cached_property
    def degraded_map(self) -> dict[StageType, int]:
        return dict(self.degraded)


class TermsCache:
    """StageCostTerms per (tp, stages) for one outer choice; layer costs shared per tp.

    memory_replicas: replicas ZeRO-1 shards optimizer state over (memory, optimizer step).
    link_replicas: replicas assumed when deciding whether pipeline sends stay in a node; a
        template's replicas are placed only after the search, so this is the most there can be.
    shared: a dict one search passes to all its caches, so memory caps and stage times
        (which do not depend on the nominal pp) are computed once.
    """

    def __init__(
        self,
        problem: PlanningProblem,
        outer: OuterChoice,
        memory_replicas: int,
        link_replicas: int | None = None,
        shared: dict | None = None,
        job_devices: int | None = None,
    ) -> None:
        self._problem = problem
        self._outer = outer
        self._replicas = memory_replicas
        self._link_replicas = max(memory_replicas, link_replicas or memory_replicas)
        self.memory_replicas = memory_replicas
        self.link_replicas = self._link_replicas
        self._job_devices = job_devices
        self._shape_key = (outer.micro_batch_size, outer.recompute, outer.virtual_stages, outer.cp)
        # The search pops each outer choice several times, with a new cache each time: whatever
        # depends on less than the whole outer choice is kept in `shared`, keyed by what it
        # depends on. Layer costs: (tp, mbs, recompute, cp).
        shared = {} if shared is None else shared
        self._parts: dict[tuple, PartSet] = shared.setdefault("parts", {})
        # Cost terms and per-stage costs: (tp, stages, mbs, recompute, v, cp, both replica counts).
        self.replicas_key = self._shape_key + (memory_replicas, self._link_replicas, job_devices)
        self._terms: dict[tuple, StageCostTerms] = shared.setdefault("terms", {})
        self._stage_costs: dict[tuple, tuple[float, ...]] = shared.setdefault("stage_costs", {})
        # Stage times: (tp, mbs, recompute, v, stages, position kind, speed) and, through the
        # pipeline links, whether a whole job of this shape fits in one node.
        self._affine: dict[tuple, tuple[float, float]] = shared.setdefault("affine", {})
        self._backward: dict[tuple, tuple[float, float]] = shared.setdefault("backward", {})
        # Memory caps, a row of positions: (tp, mbs, recompute, v, stages, memory replicas).
        self._caps_key = (outer.micro_batch_size, outer.recompute, outer.virtual_stages, outer.cp, memory_replicas)
        self._cap_rows: dict[tuple, tuple[int, ...]] = shared.setdefault("cap_rows", {})
        # Their first, last and roomiest middle stage alone (`layer_caps_outline`): the same key and memory.
        self._cap_outlines: dict[tuple, tuple[int, int, int | None]] = shared.setdefault("cap_outlines", {})
        # Template splits: (stage types, whether sends stay in a node per TP size, mbs, recompute, v, memory
        # replicas).
        self._splits: dict[tuple, tuple[int, ...] | None] = shared.setdefault("splits", {})
        # Stage times of the first, a middle and the last position: what building a template reads.
        self._affine_rows: dict[tuple, tuple[tuple[float, float], ...]] = shared.setdefault("affine_rows", {})

    def stage_affine(self, stage_type: StageType, stages: int, position: int) -> tuple[float, float]:
        """(per-layer ms, fixed ms) of a stage; only first, middle and last positions differ in time."""
        kind = 0 if position == 0 else (2 if position == stages - 1 else 1)
        key = (stage_type, stages, kind, self.links_in_node(stage_type.tp, stages)) + self._shape_key
        if key not in self._affine:
            terms = self.terms(stage_type.tp, stages)
            zero = stage_total_ms(terms, position, 0, stage_type.speed)
            self._affine[key] = (stage_total_ms(terms, position, 1, stage_type.speed) - zero, zero)
        return self._affine[key]

    def stage_affines(self, stage_type: StageType, stages: int) -> tuple[tuple[float, float], ...]:
        """`stage_affine` of the first, a middle and the last position."""
        key = (stage_type, stages, self.links_in_node(stage_type.tp, stages)) + self._shape_key
        if key not in self._affine_rows:
            self._affine_rows[key] = tuple(
                self.stage_affine(stage_type, stages, position) for position in (0, min(1, stages - 1), stages - 1)
            )
        return self._affine_rows[key]

    def split_of(self, stage_types: tuple[StageType, ...],
                 compute: Callable[[], tuple[int, ...] | None]) -> tuple[int, ...] | None:
        """A template's split, computed once (by `compute`) for everything it reads: the stage times, which
        see the replica counts only through whether pipeline sends stay in a node, and the memory caps."""
        stages = len(stage_types)
        links = tuple(self.links_in_node(tp, stages) for tp in sorted({st.tp for st in stage_types}))
        key = (stage_types, links) + self._caps_key
        if key not in self._splits:
            self._splits[key] = compute()
        return self._splits[key]

    def layer_caps(self, tp: int, stages: int, memory_bytes: float) -> tuple[int, ...]:
        """Most layers a stage fits in memory, per position (microbatches in flight differ)."""
        key = (tp, stages) + self._caps_key
        if key not in self._cap_rows:
            self._cap_rows[key] = max_layers_fitting_all(self.terms(tp, stages), memory_bytes)
        return self._cap_rows[key]

    def caps_could_split(self, tp: int, stages: int, memory_bytes: float, layers: int, unit: int) -> bool:
        """Whether `layer_caps` could allow a split into `stages` stages of multiples of `unit` layers, told
        from the first, last and roomiest middle stage alone: False exactly where `best_split` would find
        nothing even with every middle stage as roomy as the roomiest."""
        key = (tp, stages, memory_bytes) + self._caps_key
        if key not in self._cap_outlines:
            self._cap_outlines[key] = layer_caps_outline(self.terms(tp, stages), memory_bytes)
        first, last, middle = self._cap_outlines[key]
        units = layers // unit
        if layers % unit or units < stages or min(first, last) < unit:
            return False
        ends = min(first // unit, units) + (min(last // unit, units) if stages > 1 else 0)
        return ends + (stages - 2) * min((middle or 0) // unit, units) >= units

    def backward_affine(self, tp: int, stages: int, position: int) -> tuple[float, float]:
        """(per-layer ms, fixed ms) of a stage's backward pass at full speed."""
        kind = 0 if position == 0 else (2 if position == stages - 1 else 1)
        key = (tp, stages, kind, self.links_in_node(tp, stages)) + self._shape_key
        if key not in self._backward:
            terms = self.terms(tp, stages)
            zero = stage_backward_ms(terms, position, 0)
            self._backward[key] = (stage_backward_ms(terms, position, 1) - zero, zero)
        return self._backward[key]

    def links_in_node(self, tp: int, stages: int) -> bool:
        """Whether pipeline sends stay in a node (`stage_cost_terms`: the job's devices fit one). While
        searching, a job of `link_replicas` pipelines of `stages` groups of `tp` GPUs stands for the
        layout; once it is known, its device count (`job_devices`) decides for every stage alike."""
        if self._job_devices is not None:
            return self._job_devices <= self._problem.hardware.gpus_per_node
        return tp * self._outer.cp * stages * self._link_replicas <= self._problem.hardware.gpus_per_node

    def terms(self, tp: int, stages: int) -> StageCostTerms:
        key = (tp, stages) + self.replicas_key
        if key not in self._terms:
            problem, outer = self._problem, self._outer
            shape = ParallelShape(
                tp, stages, self._replicas, outer.micro_batch_size, outer.recompute,
                ScheduleName.INTERLEAVED if outer.virtual_stages > 1 else ScheduleName.ONE_F_ONE_B, outer.virtual_stages,
                cp=outer.cp,
            )
            parts = self._part_set(tp)
            terms = stage_cost_terms(problem.workload, problem.hardware, shape, problem.efficiency, problem.software, parts)
            changes = {}
            if self._job_devices is not None:
                changes["p2p_ms"] = pipeline_p2p_ms(problem.workload, problem.hardware, shape, problem.efficiency,
                                                    problem.software, in_node=self.links_in_node(tp, stages))
            elif self._link_replicas > self._replicas:
                changes["p2p_ms"] = pipeline_p2p_ms(
                    problem.workload, problem.hardware, replace(shape, dp=self._link_replicas),
                    problem.efficiency, problem.software,
                )
            if outer.virtual_stages > 1:
                # Replicas get any microbatch count, and interleaving holds the most
                # for m = 2p - 1 (one group of 2p - 1): size memory for that.
                changes["num_microbatches"] = 2 * stages - 1
            self._terms[key] = replace(terms, **changes) if changes else terms
        return self._terms[key]

    def layer_time(self, tp: int) -> LayerTime:
        """One layer's time at TP size `tp`: it depends on neither the stage count nor the replicas."""
        return self._part_set(tp).layer.time

    def _part_set(self, tp: int) -> PartSet:
        """Layer, embedding and head costs (`part_costs` reads only tp, cp, micro-batch size and recompute)."""
        outer = self._outer
        key = (tp, outer.micro_batch_size, outer.recompute, outer.cp)
        if key not in self._parts:
            problem = self._problem
            shape = ParallelShape(tp, 1, 1, outer.micro_batch_size, outer.recompute, cp=outer.cp)
            self._parts[key] = part_costs(problem.workload, problem.hardware, shape, problem.efficiency, problem.software)
        return self._parts[key]


def degraded_positions(stages: int) -> list[int]:
    return list(range(1, stages - 1)) + ([0, stages - 1] if stages > 1 else [0])


def arrange(stages: int, base: StageType, degraded: tuple[StageType, ...]) -> tuple[StageType, ...]:
    """Stage types by position: degraded ones (strongest first) in middle positions first."""
    order = [base] * stages
    for position, stage_type in zip(degraded_positions(stages), sorted(degraded, reverse=True)):
        order[position] = stage_type
    return tuple(order)


def build_template(
    problem: PlanningProblem,
    outer: OuterChoice,
    cache: TermsCache,
    stage_types: tuple[StageType, ...],
    base: StageType,
    sync_replicas: int,
) -> Template | None:
    stages = len(stage_types)
    capacity = problem.usable_memory_bytes
    rows = {st: (cache.stage_affines(st, stages), cache.layer_caps(st.tp, stages, capacity)) for st in set(stage_types)}
    return _build_template(problem, outer, cache, stage_types, rows, base, sync_replicas)


def _build_template(
    problem: PlanningProblem,
    outer: OuterChoice,
    cache: TermsCache,
    stage_types: tuple[StageType, ...],
    rows: dict[StageType, tuple[tuple[tuple[float, float], ...], tuple[int, ...]]],
    base: StageType,
    sync_replicas: int,
) -> Template | None:
    """`build_template` with each stage type's stage times and memory caps already fetched."""
    split = cache.split_of(stage_types, lambda: _split_of_rows(problem, outer, stage_types, rows))
    if split is None:
        return None
    return template_costs(problem, cache, stage_types, split, base, sync_replicas)


def _split_of_rows(
    problem: PlanningProblem,
    outer: OuterChoice,
    stage_types: tuple[StageType, ...],
    rows: dict[StageType, tuple[tuple[tuple[float, float], ...], tuple[int, ...]]],
) -> tuple[int, ...] | None:
    stages = len(stage_types)
    per_layer, fixed, caps = [], [], []
    for i, st in enumerate(stage_types):
        affines, type_caps = rows[st]
        per_layer_ms, fixed_ms = affines[0 if i == 0 else (2 if i == stages - 1 else 1)]
        per_layer.append(per_layer_ms)
        fixed.append(fixed_ms)
        caps.append(type_caps[i])
    return best_split(per_layer, fixed, caps, problem.workload.model.num_layers, outer.virtual_stages)


def _stage_costs(
    problem: PlanningProblem, cache: TermsCache, stage_type: StageType, stages: int, position: int, layers: int,
    sync_replicas: int,
) -> tuple[float, ...]:
    """(time per microbatch, parameters per GPU, exposed uniform sync, exposed resharded sync,
    optimizer step, and at full speed forward, backward and weight gradient per microbatch) of one stage;
    memoized, since base stages repeat across templates."""
    kind = 0 if position == 0 else (2 if position == stages - 1 else 1)
    key = (stage_type, stages, kind, layers, sync_replicas) + cache.replicas_key
    memo = cache._stage_costs
    if key in memo:
        return memo[key]
    terms = cache.terms(stage_type.tp, stages)
    per_layer, fixed = cache.stage_affine(stage_type, stages, position)
    backward_per_layer, backward_fixed = cache.backward_affine(stage_type.tp, stages, position)
    backward = layers * backward_per_layer + backward_fixed
    params = layers * terms.layer.params
    params += terms.embedding.params if position == 0 else 0.0
    params += terms.head.params if position == stages - 1 else 0.0
    network = problem.hardware.inter_node_bandwidth_gb_s * problem.efficiency.network_fraction
    bucket_params = min(terms.bucket_params, params)
    full_speed = (stage_forward_ms(terms, position, layers), stage_backward_ms(terms, position, layers),
                  stage_weight_grad_ms(terms, position, layers))
    forward = full_speed[0]
    # The gradient reduction under the last backward, then ZeRO-1's weight all-gather under the next forward
    # (`cost_models.iteration.exposed_dp_sync_ms`).
    # Every CP rank holds the stage's weights: gradients sync over replicas x cp ranks, as Megatron's
    # data-parallel-with-CP group does.
    ranks = sync_replicas * terms.shape.cp
    if sync_replicas > 1:
        uniform = (exposed_sync_ms(terms.dp_sync_ms(params, ranks), backward,
                                   terms.dp_sync_ms(bucket_params, ranks), terms.overlap_grad_reduce)
                   + exposed_sync_ms(terms.param_gather_ms(params, ranks), forward,
                                     terms.param_gather_ms(bucket_params, ranks), terms.overlap_param_gather))
    else:
        uniform = 0.0
    resharded = sum(
        exposed_sync_ms(resharded_sync_ms(params, layers, ranks, bytes_per_param, network), overlapped_ms,
                        resharded_sync_ms(bucket_params, 1, ranks, bytes_per_param, network), overlap)
        for bytes_per_param, overlapped_ms, overlap in (
            (terms.sync_bytes_per_param, backward, terms.overlap_grad_reduce),
            (terms.gather_bytes_per_param, forward, terms.overlap_param_gather)))
    memo[key] = (layers * per_layer + fixed, params, uniform, resharded, params * terms.optimizer_ms_per_param, *full_speed)
    return memo[key]


def template_costs(
    problem: PlanningProblem,
    cache: TermsCache,
    stage_types: tuple[StageType, ...],
    split: tuple[int, ...],
    base: StageType,
    sync_replicas: int,
) -> Template:
    """Every cost of one template with a given split (also used by the brute-force tests)."""
    stages = len(stage_types)
    last = stages - 1
    # Middle stages of one type and layer count cost the same: look each such stage up once.
    seen: dict[tuple, tuple[float, ...]] = {}
    costs = []
    for i, (st, n) in enumerate(zip(stage_types, split)):
        key = (st, 0 if i == 0 else (2 if i == last else 1), n)
        found = seen.get(key)
        if found is None:
            found = seen[key] = _stage_costs(problem, cache, st, stages, i, n, sync_replicas)
        costs.append(found)
    totals, params, uniform, resharded, optimizer, forwards, backwards, weight_grads = zip(*costs)
    degraded: dict[StageType, int] = {}
    for st in stage_types:
        if st is not base and st != base:
            degraded[st] = degraded.get(st, 0) + 1
    return Template(
        stage_types=stage_types,
        layers_per_stage=split,
        stage_ms=totals,
        params_per_gpu=params,
        bottleneck_ms=max(totals),
        total_ms=sum(totals),
        sync_uniform_ms=max(uniform),
        sync_resharded_ms=max(resharded),
        optimizer_ms=max(optimizer),
        base_groups=stages - sum(degraded.values()),
        degraded=tuple(sorted(degraded.items())),
        forward_floor_ms=forwards,
        backward_floor_ms=backwards,
        weight_grad_floor_ms=weight_grads,
    )


def floor_pieces(template: Template, virtual_stages: int, full_backward: bool) -> tuple[tuple[int, int], ...]:
    """A template's price under every allowed schedule, as allocation pieces (v-times ticks, offsets
    rounded down): no schedule runs q microbatches on it faster than the largest of these terms of
    `planner.schedules.bounds.lower_bound_ms` (latencies and memory caps left out). Per stage s, with t_s
    its time per microbatch at its speed and f, b = i + w (input and weight gradient) at full speed, below
    any slower stage's; chunk c of stage u is virtual stage c p + u, each chunk taking 1/v of its stage
    (chunk 0 of stage 0 also holds the embedding, the last chunk of the last stage the head, so the
    chunks named below take at least that):

    * q t_s + h_s / v: stage s runs its own ops one at a time, after its first forward waited for chunk 0
      of every stage before it; with whole backward ops only (GPipe, 1F1B, interleaved) its last B is
      followed by the B chain down to stage 0, so h_s sums f + b over u < s, else f alone.
    * q b_s + sum f + a_s / v: no backward of s starts before a forward has gone through every virtual
      stage and the gradient back through the last chunks of the stages after s (a_s sums i, or b, over
      u > s); with whole backward ops the last B is followed by the chain down to stage 0 (a_s also sums
      b over u < s).
    * split backward only, q i_s + sum f + (sum over u != s of i_u + w_0) / v: after its last I, stage s
      still owes the I chain down to stage 0 and the W there.
    """
    v, p = virtual_stages, len(template.stage_ms)
    forwards, backwards = template.forward_floor_ms, template.backward_floor_ms
    inputs = [b - w for b, w in zip(backwards, template.weight_grad_floor_ms)]
    chain = v * sum(forwards)
    ms: list[tuple[float, float]] = []
    for s in range(p):
        before = sum(forwards[:s]) + (sum(backwards[:s]) if full_backward else 0.0)
        ms.append((template.stage_ms[s], before))
        if full_backward:
            ms.append((backwards[s], chain + sum(backwards) - backwards[s]))
        else:
            ms.append((backwards[s], chain + sum(inputs[s + 1:])))
            ms.append((inputs[s], chain + sum(inputs) - inputs[s] + template.weight_grad_floor_ms[0]))
    pieces = [(v * round(slope / TIME_QUANTUM_MS), math.floor(offset / TIME_QUANTUM_MS)) for slope, offset in ms]
    # A piece no steeper and no higher than another never sets the price: keep the others, steepest first.
    kept, highest = [], -math.inf
    for slope, offset in sorted(set(pieces), key=lambda piece: (-piece[0], -piece[1])):
        if offset > highest:
            kept.append((slope, offset))
            highest = offset
    return tuple(kept)


def stage_timings(cache: TermsCache, template: Template) -> list[StageTime]:
    """Full per-stage timing and memory of a template (for the plan; the search needs less)."""
    stages = len(template.stage_types)
    return [
        stage_time(cache.terms(st.tp, stages), i, n, st.speed)
        for i, (st, n) in enumerate(zip(template.stage_types, template.layers_per_stage))
    ]


def enumerate_templates(
    problem: PlanningProblem,
    outer: OuterChoice,
    cache: TermsCache,
    degraded_types: list[StageType],
    sync_replicas: int,
    memo: dict | None = None,
    most_groups: Mapping[StageType, int] | None = None,
) -> list[Template]:
    """Every template of the outer choice that fits memory. `memo` shares templates between
    outer choices of one search: a template depends on its stage sequence, micro-batch size,
    recompute, chunks and the replica counts its costs assume, not on the nominal pp.
    `most_groups`, the most groups of each type the nodes can form at once, leaves out
    templates no allocation could ever build."""
    base = StageType(outer.tp, 1.0)
    memo = {} if memo is None else memo
    capacity = problem.usable_memory_bytes

    def buildable(needed: int, stage_type: StageType) -> bool:
        return most_groups is None or needed <= most_groups.get(stage_type, 0)

    out = []
    for stages in reversed(pipeline_lengths(outer.pp, problem.config)):
        # Every template of this length reads the rows of the base type and of its degraded type.
        rows = {}

        def row(stage_type: StageType, stages: int = stages, rows: dict = rows) -> tuple:
            if stage_type not in rows:
                rows[stage_type] = (cache.stage_affines(stage_type, stages), cache.layer_caps(stage_type.tp, stages, capacity))
            return rows[stage_type]

        # Forms: base groups only, one degraded stage among base groups, every stage one degraded type.
        forms = [(_BASE_ONLY, base)] if buildable(stages, base) else []
        if stages in degraded_lengths(outer.pp, problem.config):
            if buildable(stages - 1, base):
                forms += [(_ONE_DEGRADED, stage_type) for stage_type in sorted(degraded_types)]
            if stages > 1:
                forms += [(_ALL_DEGRADED, st) for st in sorted(degraded_types) if buildable(stages, st)]
        for form, stage_type in forms:
            key = (outer.tp, stages, form, stage_type, outer.micro_batch_size, outer.recompute, outer.virtual_stages,
                   outer.cp, cache.memory_replicas, cache.link_replicas, sync_replicas)
            if key not in memo:
                if form == _BASE_ONLY:
                    sequence = arrange(stages, base, ())
                elif form == _ONE_DEGRADED:
                    sequence = arrange(stages, base, (stage_type,))
                else:
                    sequence = (stage_type,) * stages
                used = {st: row(st) for st in (base, stage_type) if st in sequence}
                memo[key] = _build_template(problem, outer, cache, sequence, used, base, sync_replicas)
            if memo[key] is not None:
                out.append(memo[key])
    return out


# Template forms (see the module docstring).
_BASE_ONLY, _ONE_DEGRADED, _ALL_DEGRADED = 0, 1, 2


