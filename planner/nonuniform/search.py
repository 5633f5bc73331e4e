"""Failure-aware search over non-uniform layouts: outer branch and bound, CP-SAT allocation inside.

Outer choices (base TP size, stage count, micro-batch size, recompute,
chunks) are ordered by a lower bound valid for every layout they allow:
with C the summed per-layer throughput of every TP group the nodes can form
and R the most replicas, any replica r running m_r microbatches takes at
least (m_r - 1/v) L / C_r + L a_min / v, so summing the microbatches gives
    T >= (N - R / v) L / C + L a_min / v,
which is tight for balanced layouts. For each outer choice whose bound can
still beat the incumbent, templates are built and CP-SAT allocates them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, replace

from cost_models.resharding import nonuniform_iteration_ms
from planner.budget import Budget
from planner.config import TIME_QUANTUM_MS, PlannerConfig
from planner.nonuniform.allocation.input import need
from planner.nonuniform.allocation.search import (
    Allocation,
    AllocationInput,
    AllocationSearch,
)
from planner.nonuniform.layer_splits import best_split
from planner.nonuniform.partitions import (
    NodeClass,
    Partition,
    StageType,
    damaged_classes,
    node_partitions,
)
from planner.nonuniform.templates import (
    OuterChoice,
    Template,
    TermsCache,
    enumerate_templates,
    floor_pieces,
    pipeline_lengths,
)
from planner.problem import PlanningProblem
from planner.schedules.bounds import full_backward_only
from planner.uniform.candidates import tensor_parallel_sizes
from planner.work import Work


@dataclass(frozen=True)
class NonUniformLayout:
    outer: OuterChoice
    templates: tuple[Template, ...]
    allocation: Allocation
    classes: tuple[NodeClass, ...]
    partitions: tuple[tuple[Partition, ...], ...]
    iteration_ms: float
    memory_replicas: int  # what the templates' ZeRO memory was computed for
    link_replicas: int  # what the templates' pipeline links were costed for
    job_devices: int | None = None  # once recosted: the devices the layout uses (its links are priced by them)

    def replica_plan(self) -> list[tuple[Template, list[int]]]:
        """Per used template, the microbatches of each of its replicas (balanced, heaviest first)."""
        out = []
        for template, count, work in zip(self.templates, self.allocation.replicas_per_template,
                                         self.allocation.microbatches_per_template):
            if count == 0:
                continue
            base, extra = divmod(work, count)
            out.append((template, [base + 1 if i < extra else base for i in range(count)]))
        return out

    def terms_cache(self, problem: PlanningProblem) -> TermsCache:
        return TermsCache(problem, self.outer, self.memory_replicas, self.link_replicas, job_devices=self.job_devices)


@dataclass(frozen=True)
class NonUniformResult:
    layout: NonUniformLayout | None
    bound_ms: float
    exhausted: bool
    outer_total: int
    outer_solved: int
    layout_value_ms: float = float("inf")  # what the search valued the layout at (`NonUniformSearch.best_ms`)


def evaluate_layout(layout_templates, allocation: Allocation, virtual_stages: int) -> float:
    """Iteration time of an allocation, recomputed from the cost model (not from the solver's ticks)."""
    used = [(t, n, w) for t, n, w in zip(layout_templates, allocation.replicas_per_template,
                                         allocation.microbatches_per_template) if n > 0]
    mixed = len({t.sharding for t, _, _ in used}) > 1
    replicas = [(t.stage_ms, -(-w // n)) for t, n, w in used]
    syncs = [t.sync_resharded_ms if mixed else t.sync_uniform_ms for t, _, _ in used]
    optimizers = [t.optimizer_ms for t, _, _ in used]
    return nonuniform_iteration_ms(replicas, virtual_stages, syncs, optimizers)


@dataclass(frozen=True)
class _Inventory:
    base: StageType
    healthy_base_groups: int
    classes: tuple[NodeClass, ...]
    partitions: tuple[tuple[Partition, ...], ...]
    degraded: tuple[StageType, ...]
    most_groups: int
    most_of_type: tuple[tuple[StageType, int], ...]  # most groups of each type formed at once

    def degraded_types(self) -> list[StageType]:
        return list(self.degraded)

    def group_count_bound(self) -> int:
        return self.most_groups


def _inventory(problem: PlanningProblem, tp: int, sizes: list[int]) -> _Inventory:
    cluster = problem.cluster
    classes = tuple(damaged_classes(cluster))
    allowed = tuple(s for s in sizes if s <= tp)
    partitions = tuple(tuple(node_partitions(c.profile, allowed)) for c in classes)
    healthy_nodes = cluster.num_nodes - len(cluster.damaged_nodes)
    base = StageType(tp, 1.0)
    healthy_groups = healthy_nodes * (cluster.gpus_per_node // tp)
    degraded = tuple(sorted({g for ps in partitions for p in ps for g in p.groups if g != base}))
    most = healthy_groups + sum(len(c.nodes) * max((len(p.groups) for p in ps), default=0) for c, ps in zip(classes, partitions))
    most_of_type = {base: healthy_groups}
    for c, ps in zip(classes, partitions):
        for st in {g for p in ps for g in p.groups}:
            most_of_type[st] = most_of_type.get(st, 0) + len(c.nodes) * max(p.counts()[st] for p in ps)
    return _Inventory(base, healthy_groups, classes, partitions, degraded, most, tuple(sorted(most_of_type.items())))


def _per_layer_ms(cache: TermsCache, stage_type: StageType) -> float:
    time = cache.layer_time(stage_type.tp)
    return (time.forward_compute_ms + time.backward_compute_ms) / stage_type.speed + time.forward_comm_ms + time.backward_comm_ms


def _ends_in_layers(cache: TermsCache, tps: list[int]) -> float:
    """Embedding plus head work in units of one layer of the same TP size (least over sizes)."""
    ratios = []
    for tp in tps:
        terms = cache.terms(tp, 2)
        ends = sum(p.time.forward_ms + p.time.backward_ms for p in (terms.embedding, terms.head))
        ratios.append(ends / (terms.layer.time.forward_ms + terms.layer.time.backward_ms))
    return min(ratios)


@dataclass(frozen=True)
class _Capacity:
    """Per-layer figures of one (tp, micro-batch size, recompute): they do not depend on pp or v.

    work: layers plus embedding and head, in layer units; throughput: layers per ms all the
    groups the nodes can form achieve together; fastest: the least per-layer time of any group.
    """

    work: float
    throughput: float
    fastest: float


def _capacity_summary(problem: PlanningProblem, outer: OuterChoice, inventory: _Inventory) -> _Capacity:
    cache = TermsCache(problem, OuterChoice(outer.tp, 1, outer.micro_batch_size, outer.recompute), 1)
    per_layer = {g: _per_layer_ms(cache, g) for g in (inventory.base, *inventory.degraded)}
    throughput = inventory.healthy_base_groups / per_layer[inventory.base]
    for node_class, partitions in zip(inventory.classes, inventory.partitions):
        best = max((sum(1 / per_layer[g] for g in p.groups) for p in partitions), default=0.0)
        throughput += len(node_class.nodes) * best
    sizes = sorted({g.tp for g in per_layer})
    work = problem.workload.model.num_layers + _ends_in_layers(cache, sizes)
    return _Capacity(work, throughput, min(per_layer.values()))


def _lower_bound_ms(problem: PlanningProblem, outer: OuterChoice, inventory: _Inventory, capacity: _Capacity, shortest: int) -> float:
    """The larger of two bounds, E the embedding and head in layer units, R the most replicas
    (pipelines of at least `shortest` stages, each running a microbatch):
      balanced:  (N - R / v) (L + E) / C + (L + E) a_min / v
      busiest:   (ceil(N / R) - 1 / v) (L + E) a_min / pp + (L + E) a_min / v."""
    total = problem.workload.global_batch_size // outer.micro_batch_size
    v = outer.virtual_stages
    if capacity.throughput <= 0:
        return float("inf")
    work, fastest = capacity.work, capacity.fastest
    most_replicas = max(1, min(total, inventory.group_count_bound() // shortest))
    balanced = max(0.0, (total - most_replicas / v) * work / capacity.throughput) + work * fastest / v
    # Since S_r >= M_r, also T >= m_r M_r >= m_r (L + E) / C_r: N (L + E) / C without fill.
    throughput = total * work / capacity.throughput
    # Some replica runs ceil(N / R) microbatches, on at most pp stages of the fastest kind.
    busiest = (-(-total // most_replicas) - 1 / v) * work * fastest / outer.pp + work * fastest / v
    return max(balanced, throughput, busiest)


def _simulation_floor_ms(problem: PlanningProblem, outer: OuterChoice, inventory: _Inventory, capacity: _Capacity,
                         shortest: int, full_backward: bool) -> float:
    """Below the reported (simulated) time of every layout of `outer`, whatever allowed schedule each
    replica runs; the bounds above price the 1F1B bubble model instead, which a zero-bubble schedule beats.

    A stage runs its own ops one at a time, so replica r with m_r microbatches takes at least m_r M_r:
    summed as in `_lower_bound_ms`, T >= N (L + E) / C. The busiest replica runs m >= ceil(N / R)
    microbatches on at most pp stages whose work W is at least (L + E) a_min, so T >= m W / pp; and when
    every allowed schedule runs whole backward ops, each stage s also waits for 1/v of the work of the
    stages before it (`planner.schedules.bounds`), T >= P_s / v + m t_s, whose least over all splits of W
    into p stages is g = (W / v) / (1 - (1 - 1 / (v m))^p) (`planner.uniform.candidates._lower_bound_ms`),
    larger for larger m and W and smaller for larger p: valid at m = ceil(N / R), W = (L + E) a_min, p = pp.
    Gradient sync and optimizer steps are left out (>= 0)."""
    if capacity.throughput <= 0:
        return float("inf")
    total = problem.workload.global_batch_size // outer.micro_batch_size
    work_ms = capacity.work * capacity.fastest
    busiest = -(-total // max(1, min(total, inventory.group_count_bound() // shortest)))
    floor = max(total * capacity.work / capacity.throughput, busiest * work_ms / outer.pp)
    if full_backward:
        share = 1.0 / outer.virtual_stages
        floor = max(floor, share * work_ms / (1 - (1 - share / busiest) ** outer.pp))
    return floor


def _memory_replicas(problem: PlanningProblem, outer: OuterChoice, inventory: _Inventory) -> int:
    """Replicas ZeRO-1 memory is computed for; the allocation must build at least this many."""
    if problem.workload.zero_stage < 1:
        return 1
    microbatches = problem.workload.global_batch_size // outer.micro_batch_size
    return max(1, min(microbatches, inventory.healthy_base_groups // outer.pp))


def _link_replicas(outer: OuterChoice, inventory: _Inventory, config: PlannerConfig) -> int:
    """The most replicas an outer choice can build: gradient sync and pipeline links are costed
    for this many during the search (more replicas never make either cheaper)."""
    return max(1, inventory.group_count_bound() // pipeline_lengths(outer.pp, config)[0])


def outer_choices(problem: PlanningProblem) -> list[OuterChoice]:
    layers = problem.workload.model.num_layers
    batch = problem.workload.global_batch_size
    out = []
    for tp in tensor_parallel_sizes(problem):
        for mbs in problem.micro_batch_sizes:
            if batch % mbs:
                continue
            for pp in range(1, layers + 1):
                chunks = [1] + [v for v in range(2, problem.config.max_virtual_stages + 1) if pp >= 2 and layers % v == 0 and layers // v >= pp]
                for v in filter(problem.allows_virtual_stages, chunks):
                    for recompute in problem.recompute_modes:
                        out.append(OuterChoice(tp, pp, mbs, recompute, v))
    return out


def _base_bottleneck_ms(
    problem: PlanningProblem, outer: OuterChoice, cache: TermsCache, stages: int, memo: dict | None = None
) -> float | None:
    """Bottleneck of the base-only template with `stages` stages (None if it does not fit);
    `memo` shares it between outer choices of one search (adjacent pp share lengths)."""
    # What the split reads: stage times (which see the replica counts only through whether pipeline sends
    # stay in a node) and memory caps (through ZeRO's replicas).
    key = (outer.tp, outer.micro_batch_size, outer.recompute, outer.virtual_stages, stages,
           cache.memory_replicas, cache.links_in_node(outer.tp, stages))
    if memo is not None and key in memo:
        return memo[key]
    value = _base_bottleneck_uncached(problem, outer, cache, stages)
    if memo is not None:
        memo[key] = value
    return value


def _base_bottleneck_uncached(problem: PlanningProblem, outer: OuterChoice, cache: TermsCache, stages: int) -> float | None:
    layers = problem.workload.model.num_layers
    if not cache.caps_could_split(outer.tp, stages, problem.usable_memory_bytes, layers, outer.virtual_stages):
        return None  # most outer choices' pipelines do not fit memory: ruled out without a row of caps
    base = StageType(outer.tp, 1.0)
    affines = cache.stage_affines(base, stages)
    per_layer, fixed = [], []
    for i in range(stages):
        per_layer_ms, fixed_ms = affines[0 if i == 0 else (2 if i == stages - 1 else 1)]
        per_layer.append(per_layer_ms)
        fixed.append(fixed_ms)
    caps = list(cache.layer_caps(outer.tp, stages, problem.usable_memory_bytes))
    split = best_split(per_layer, fixed, caps, layers, outer.virtual_stages)
    if split is None:
        return None
    return max(n * a + b for n, a, b in zip(split, per_layer, fixed))


def _strong_lower_bound_ms(
    problem: PlanningProblem, outer: OuterChoice, inventory: _Inventory, cache: TermsCache, capacity: _Capacity,
    memo: dict | None = None, simulated: bool = False,
) -> float:
    """A tighter bound from each allowed length's exact base bottleneck M(p).

    Replica r running m_r microbatches takes T >= (m_r - 1/v) M_r + W/v with
    W = (L + E) a_min, so N <= (T - W/v) sum_r 1/M_r + R/v. The rate sum is
    bounded by crediting groups: weaker stages never lower a min-max split,
    so a p-stage replica has 1/M_r <= 1/M(p), and its rate is also at most
    its stages' summed relative capacity over K = (L + E) a_base. A base group
    earns at most mu = max_p 1 / (p M(p)); a degraded group of relative
    capacity rho earns at most its best marginal gain, in a replica of its
    own kind (rho / K per stage) or with p - 1 base groups
    (min(1/M(p), (p - 1 + rho)/K) - (p - 1) mu). As S_r >= M_r, also
    T >= m_r M_r, so N <= T sum_r 1/M_r without the per-replica 1/v. With the
    busiest replica (ceil(N / R) microbatches, rate at most max_p 1/M(p)) this
    gives three bounds. `simulated`: only those without the bubble model's fill (T >= m_r M_r holds for
    every schedule, a stage running its own work one op at a time): below every reported time.
    """
    total = problem.workload.global_batch_size // outer.micro_batch_size
    v = outer.virtual_stages
    fill = capacity.work * capacity.fastest / v
    bottlenecks = {}
    for stages in pipeline_lengths(outer.pp, problem.config):
        bottleneck = _base_bottleneck_ms(problem, outer, cache, stages, memo)
        if bottleneck is not None:
            bottlenecks[stages] = bottleneck
    if not bottlenecks:
        return float("inf")
    base_ms = _per_layer_ms(cache, inventory.base)
    full = capacity.work * base_ms  # K
    per_group = max(1 / (p * m) for p, m in bottlenecks.items())  # mu

    def credit(stage_type: StageType) -> float:
        if stage_type == inventory.base:
            return per_group
        rho = base_ms / _per_layer_ms(cache, stage_type)
        alongside = max(min(1 / m, (p - 1 + rho) / full) - (p - 1) * per_group for p, m in bottlenecks.items())
        return max(0.0, rho / full, alongside)

    credits = {g: credit(g) for g in (inventory.base, *inventory.degraded)}
    rate = inventory.healthy_base_groups * per_group
    for node_class, partitions in zip(inventory.classes, inventory.partitions):
        rate += len(node_class.nodes) * max((sum(credits[g] for g in p.groups) for p in partitions), default=0.0)
    if rate <= 0:
        return float("inf")
    most_replicas = max(1, min(total, inventory.group_count_bound() // min(bottlenecks)))
    balanced = fill + max(0.0, total - most_replicas / v) / rate
    # S_r >= M_r also gives T >= m_r M_r: no free fill per replica, however many there are.
    throughput = total / rate
    if simulated:
        return max(throughput, -(-total // most_replicas) * min(bottlenecks.values()))
    busiest = fill + (-(-total // most_replicas) - 1 / v) * min(bottlenecks.values())
    return max(balanced, throughput, busiest)


class NonUniformSearch:
    """Best non-uniform layout, one refinement at a time; bound over what was not excluded.

    Outer choices sit in a priority queue keyed by their bound and are refined
    lazily, each refinement going back in the queue: the cheap capacity bound
    first, then the strong bound (exact base bottlenecks), then the templates
    are built and the bound gains the least tail any template has (every
    plan's tail is at least one of its templates' uniform sync plus optimizer
    step), then the
    allocation's own bound (`AllocationSearch.front_ms`), which rises as its
    tail sets are refined and settled one per step. CP-SAT runs only for
    outer choices whose refined bound still beats the incumbent. `step` takes
    the incumbent each time, so `plan` can interleave this search with the
    uniform one, always refining the smaller bound.
    """

    def __init__(self, problem: PlanningProblem, value_of: Callable[[NonUniformLayout], tuple[float, int]] | None = None,
                 caches: dict | None = None, budget: Budget | None = None) -> None:
        """Priced by the bubble model; with `value_of` (a layout's reported iteration time, ms, and what valuing it
        cost in refinements: `valuing_steps` sums them), priced by simulation floors instead (`floor_pieces`): every
        bound then holds for the reported time, each
        allocation found is valued by `value_of`, and `best_ms` is that value. `caches`, a dict another
        search of the same problem filled, saves building its templates and stage costs again (`budget`: charged)."""
        self._problem = problem
        self._value_of = value_of
        self.valuing_steps = 0
        self._full_backward = full_backward_only(problem.allowed_schedules)
        self._best_value = float("inf")
        # Least floor of an outer choice left with its floor-optimal allocation valued above that floor:
        # another of its allocations could still lie between the two.
        self._residual_ms = float("inf")
        self._pieces: dict[tuple[int, int], tuple[Template, tuple]] = {}  # the template kept: its id stays its own
        # What does not depend on the pricing is kept in `caches`, which two searches of one problem share.
        caches = {} if caches is None else caches
        if "inventories" not in caches:
            sizes = tensor_parallel_sizes(problem)
            caches["inventories"] = {tp: _inventory(problem, tp, sizes) for tp in sizes}
        self._inventories: dict[int, _Inventory] = caches["inventories"]
        self._capacities: dict[tuple[int, int, str], _Capacity] = caches.setdefault("capacities", {})
        self._bottlenecks: dict[tuple, float | None] = caches.setdefault("bottlenecks", {})
        # Memory caps and stage times shared by every TermsCache, and templates shared by outer choices.
        self._shared: dict = caches.setdefault("terms", {})
        self._template_memo: dict[tuple, Template | None] = caches.setdefault("templates", {})
        self._built: dict[int, list[Template]] = {}
        self._searches: dict[int, AllocationSearch] = {}
        self._queue = self._initial_queue(budget or Budget.unlimited())
        # Priced by floors, outer choices whose allocation floor beats the best layout wait here and are refined
        # before the queue (a dive; see `step`); priced by the bubble model, they stay in the queue.
        self._dives: list[tuple[float, int, int, OuterChoice]] = []
        self._considered = len(self._queue)
        self._best: NonUniformLayout | None = None
        self._solved = 0
        self._unsettled_ms = float("inf")  # least bound of allocations whose probes ran out of time

    def _initial_queue(self, budget: Budget) -> list[tuple[float, int, int, OuterChoice]]:
        problem = self._problem
        queue = []
        choices = outer_choices(problem)
        for index, outer in enumerate(choices):
            inventory = self._inventories[outer.tp]
            if pipeline_lengths(outer.pp, problem.config)[0] > inventory.group_count_bound():
                continue  # not even the shortest allowed pipeline finds enough TP groups
            key = (outer.tp, outer.micro_batch_size, outer.recompute)
            if key not in self._capacities:
                self._capacities[key] = _capacity_summary(problem, outer, inventory)
            # The shortest allowed length keeps this bound valid whatever fits; whether anything
            # fits memory is checked when the outer choice reaches the front of the queue.
            shortest = pipeline_lengths(outer.pp, problem.config)[0]
            if self._value_of is not None:
                bound = _simulation_floor_ms(problem, outer, inventory, self._capacities[key], shortest, self._full_backward)
            else:
                bound = _lower_bound_ms(problem, outer, inventory, self._capacities[key], shortest)
            queue.append((bound, index, _CHEAP, outer))
        heapq.heapify(queue)
        budget.charge(Work.OUTER_CHOICE, len(choices))  # nothing above looks at the clock: charged at once
        return queue

    @property
    def best_ms(self) -> float:
        """The best layout's value: its bubble-model iteration, or with `value_of` its reported time."""
        return self._best_value

    def best_timeline_ops(self) -> int:
        """Ops of the first-choice timelines the best layout so far needs: replicas of one template
        with as many microbatches run one timeline."""
        if self._best is None:
            return 0
        v = self._best.outer.virtual_stages
        return sum(2 * len(template.stage_types) * v * m
                   for template, counts in self._best.replica_plan() for m in set(counts))

    def next_bound_ms(self) -> float:
        """Lower bound of every layout still in the queue (inf when it is empty); `result` also
        counts allocations cut short by their time limit."""
        return min(self._queue[0][0] if self._queue else float("inf"), self._dives[0][0] if self._dives else float("inf"))

    def result(self, incumbent_ms: float) -> NonUniformResult:
        """What was found; exhausted when nothing left could beat `incumbent_ms` (or the layout found)."""
        incumbent_ms = min(incumbent_ms, self.best_ms)
        left = min(self.next_bound_ms(), self._unsettled_ms)
        # The search is over when nothing queued or cut short can beat the incumbent; an outer choice's
        # residual floor is a bound on what it did not value, not work left.
        exhausted = left >= incumbent_ms * (1 - self._problem.config.prune_tolerance)
        return NonUniformResult(self._best, min(left, self._residual_ms), exhausted, self._considered, self._solved,
                                self._best_value)

    def step(self, budget: Budget, incumbent_ms: float = float("inf")) -> None:
        """Refine the front of the queue once, charged to `budget` when made; `incumbent_ms` is the best layout
        known anywhere.

        Priced by floors, an outer choice whose allocations could still beat the best layout is refined before the
        queue's front, until it is settled or no longer can (a dive, as branch-and-bound solvers dive for
        incumbents): the floors sit 10-25% below the reported times at 256 GPUs, so best-bound order spends
        every step raising the bound over thousands of outer choices and never values the one allocation that
        beats the answer. The order changes; what each bound covers does not (`next_bound_ms` is the least of
        both queues)."""
        problem = self._problem
        best_ms = min(incumbent_ms, self.best_ms)
        lower, index, stage, outer = heapq.heappop(self._dives if self._dives else self._queue)
        inventory = self._inventories[outer.tp]
        memory_replicas = _memory_replicas(problem, outer, inventory)
        link_replicas = _link_replicas(outer, inventory, problem.config)
        # Priced by floors, sync and optimizer must be at most what any allocation of this outer choice pays
        # once recosted for its own replicas: gradient sync for two (`_bound_single_replicas` bounds
        # single-replica layouts, which sync nothing, apart), the optimizer step as `_floor_templates` scales
        # it. Pipeline links stay priced for the most replicas, as the bubble-model search prices them (a
        # qualification of the bound the README states).
        sync_replicas = 2 if self._value_of is not None else link_replicas
        cache = TermsCache(problem, outer, memory_replicas, link_replicas, self._shared)
        if stage == _CHEAP:
            # The strong bound is infinite when no base-only pipeline fits memory: such outer choices drop here.
            capacity = self._capacities[(outer.tp, outer.micro_batch_size, outer.recompute)]
            tighter = max(lower, _strong_lower_bound_ms(problem, outer, inventory, cache, capacity, self._bottlenecks,
                                                        simulated=self._value_of is not None))
            budget.charge(Work.STRONG_BOUND)
            if tighter < float("inf"):
                heapq.heappush(self._queue, (tighter, index, _STRONG, outer))
            return
        if stage == _STRONG:
            templates = enumerate_templates(
                problem, outer, cache, inventory.degraded_types(), sync_replicas, self._template_memo,
                dict(inventory.most_of_type),
            )
            budget.charge(Work.TEMPLATE, max(1, len(templates)))
            if self._value_of is not None:
                templates = self._floor_templates(templates, memory_replicas, link_replicas)
            if templates:
                self._built[index] = templates
                # Priced by floors, a single-replica layout syncs nothing: only the optimizer step is owed.
                synced = self._value_of is None
                least_tail = min(t.sync_uniform_ms * synced + t.optimizer_ms for t in templates)
                heapq.heappush(self._queue, (lower + least_tail, index, _TEMPLATED, outer))
            return
        if stage == _TEMPLATED:
            data = AllocationInput(
                templates=self._built[index], base=inventory.base,
                healthy_base_groups=inventory.healthy_base_groups,
                classes=list(inventory.classes), partitions=[list(p) for p in inventory.partitions],
                microbatches=problem.workload.global_batch_size // outer.micro_batch_size,
                virtual_stages=outer.virtual_stages, min_replicas=memory_replicas,
                priced_pieces=self._floor_pieces(self._built[index], outer.virtual_stages),
            )
            del self._built[index]
            allocation_search = AllocationSearch(data, problem.random_seed, floor_ms=lower, ceiling_ms=best_ms)
        else:
            # Its tail sets are refined and settled one at a time, each time it is the front.
            allocation_search = self._searches.pop(index)
            settled = allocation_search.settled
            found_ms = allocation_search.best_ms
            allocation_search.advance(budget, ceiling_ms=best_ms)
            self._solved += settled == 0 and allocation_search.settled > 0
            if allocation_search.unsettled_ms is not None:
                # Not proven worse, only cut short: it bounds the answer from outside the queue.
                self._unsettled_ms = min(self._unsettled_ms, max(lower, allocation_search.unsettled_ms))
            if allocation_search.best_ms < found_ms:
                self._offer(outer, inventory, allocation_search, memory_replicas, link_replicas, best_ms)
                best_ms = min(best_ms, self.best_ms)
        front = allocation_search.front_ms(best_ms)
        budget.charge(Work.ALLOCATION_STEP, len(allocation_search.data.templates))
        if front < float("inf"):
            self._searches[index] = allocation_search
            heapq.heappush(self._dives if self._value_of is not None else self._queue,
                           (max(lower, front), index, _BOUNDED, outer))
        elif self._value_of is not None:
            self._leave_residual(allocation_search, best_ms)
            self._bound_single_replicas(allocation_search.data, best_ms)

    def _floor_templates(self, templates: list[Template], memory_replicas: int, most_replicas: int) -> list[Template]:
        """Templates with their optimizer step as ZeRO would shard it over the most replicas the outer choice
        can build (costed for the fewest: a step that shards is at most that share of it), so below any
        allocation's own."""
        if self._problem.workload.zero_stage < 1 or most_replicas <= memory_replicas:
            return templates
        share = memory_replicas / most_replicas
        return [replace(t, optimizer_ms=t.optimizer_ms * share) for t in templates]

    def _floor_pieces(self, templates: list[Template], virtual_stages: int) -> tuple | None:
        """Each template's floor pieces (None: priced by the bubble model); templates are shared between
        outer choices (`_template_memo`), so are their pieces."""
        if self._value_of is None:
            return None
        out = []
        for template in templates:
            key = (id(template), virtual_stages)
            if key not in self._pieces:
                self._pieces[key] = (template, floor_pieces(template, virtual_stages, self._full_backward))
            out.append(self._pieces[key][1])
        return tuple(out)

    def _bound_single_replicas(self, data: AllocationInput, best_ms: float) -> None:
        """The allocation charged every template a two-replica gradient sync; a layout of one replica (one
        template running all N microbatches) syncs nothing, so its floor without sync bounds it apart."""
        v = data.virtual_stages
        if data.min_replicas > 1:
            return
        single = min((need(pieces, data.microbatches) * TIME_QUANTUM_MS / v + t.optimizer_ms
                      for t, pieces in zip(data.templates, data.pieces)), default=float("inf"))
        single -= data.microbatches * TIME_QUANTUM_MS  # the ticks' rounding, as the allocation's slack
        if single < min(best_ms, self._best_value) * (1 - self._problem.config.prune_tolerance):
            self._residual_ms = min(self._residual_ms, single)

    def _leave_residual(self, allocation_search: AllocationSearch, best_ms: float) -> None:
        """An outer choice leaving the queue priced by floors: every allocation of it not found is no
        better than its best floor, which bounds what is left unless a layout found reaches it."""
        floor_ms = allocation_search.best_floor_ms()
        if floor_ms < min(best_ms, self._best_value) * (1 - self._problem.config.prune_tolerance):
            self._residual_ms = min(self._residual_ms, floor_ms)

    def _offer(self, outer: OuterChoice, inventory: _Inventory, allocation_search: AllocationSearch,
               memory_replicas: int, link_replicas: int, best_ms: float) -> None:
        allocation = allocation_search.allocation()
        if allocation is None:
            return
        templates = allocation_search.data.templates
        layout = NonUniformLayout(
            outer, tuple(templates), allocation, inventory.classes, inventory.partitions,
            evaluate_layout(templates, allocation, outer.virtual_stages), memory_replicas, link_replicas,
        )
        if self._value_of is None:
            value = layout.iteration_ms
        else:
            value, steps = self._value_of(layout)
            self.valuing_steps += steps
        if value < best_ms:
            self._best, self._best_value = layout, value


def search_nonuniform(problem: PlanningProblem, incumbent_ms: float, budget: Budget,
                      value_of: Callable[[NonUniformLayout], tuple[float, int]] | None = None,
                      caches: dict | None = None, max_steps: int | None = None) -> NonUniformResult:
    """Best non-uniform layout better than `incumbent_ms`, or none; bound over what was not excluded
    (see `NonUniformSearch`; `value_of` prices by simulation floors and values layouts by it), after at
    most `max_steps` refinements, the layouts valued counted at what their valuing cost."""
    search = NonUniformSearch(problem, value_of, caches, budget)
    steps = 0
    while search.next_bound_ms() < min(incumbent_ms, search.best_ms) * (1 - problem.config.prune_tolerance):
        if budget.expired() or (max_steps is not None and steps + search.valuing_steps >= max_steps):
            break
        search.step(budget, incumbent_ms)
        steps += 1
    return search.result(incumbent_ms)


# Refinement stages of an outer choice in the search queue.
_CHEAP, _STRONG, _TEMPLATED, _BOUNDED = 0, 1, 2, 3
