"""What one tensor-parallel size can build on the damaged cluster (an outer choice's inventory of TP groups), and
the lower bounds on every layout of an outer choice that order `planner.nonuniform.search`'s queue.

With C the summed per-layer throughput of every TP group the nodes can form and R the most replicas, any replica r
running m_r microbatches takes at least (m_r - 1/v) L / C_r + L a_min / v, so summing the microbatches gives
    T >= (N - R / v) L / C + L a_min / v,
which is tight for balanced layouts (`bubble_lower_bound_ms`); `strong_lower_bound_ms` tightens it with each allowed
pipeline length's exact base bottleneck, and `simulation_floor_ms` holds for the simulated (reported) time under any
allowed schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.nonuniform.layer_splits import best_split
from planner.nonuniform.partitions import NodeClass, Partition, StageType, damaged_classes, node_partitions
from planner.nonuniform.templates import OuterChoice, TermsCache, pipeline_lengths
from planner.problem import PlanningProblem


@dataclass(frozen=True)
class Inventory:
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


def build_inventory(problem: PlanningProblem, tp: int, sizes: list[int], cp: int = 1) -> Inventory:
    """What stage groups of `tp` (and smaller TP sizes among `sizes`) x `cp` GPUs the nodes can form."""
    cluster = problem.cluster
    classes = tuple(damaged_classes(cluster))
    allowed = tuple(s for s in sizes if s <= tp)
    partitions = tuple(tuple(node_partitions(c.profile, allowed, cp)) for c in classes)
    healthy_nodes = cluster.num_nodes - len(cluster.damaged_nodes)
    base = StageType(tp, 1.0)
    healthy_groups = healthy_nodes * (cluster.gpus_per_node // (tp * cp))
    degraded = tuple(sorted({g for ps in partitions for p in ps for g in p.groups if g != base}))
    most = healthy_groups + sum(len(c.nodes) * max((len(p.groups) for p in ps), default=0) for c, ps in zip(classes, partitions))
    most_of_type = {base: healthy_groups}
    for c, ps in zip(classes, partitions):
        for st in {g for p in ps for g in p.groups}:
            most_of_type[st] = most_of_type.get(st, 0) + len(c.nodes) * max(p.counts()[st] for p in ps)
    return Inventory(base, healthy_groups, classes, partitions, degraded, most, tuple(sorted(most_of_type.items())))


def per_layer_ms(cache: TermsCache, stage_type: StageType) -> float:
    time = cache.layer_time(stage_type.tp)
    return (time.forward_compute_ms + time.backward_compute_ms) / stage_type.speed + time.forward_comm_ms + time.backward_comm_ms


def ends_in_layers(cache: TermsCache, tps: list[int]) -> float:
    """Embedding plus head work in units of one layer of the same TP size (least over sizes)."""
    ratios = []
    for tp in tps:
        terms = cache.terms(tp, 2)
        ends = sum(p.time.forward_ms + p.time.backward_ms for p in (terms.embedding, terms.head))
        ratios.append(ends / (terms.layer.time.forward_ms + terms.layer.time.backward_ms))
    return min(ratios)


@dataclass(frozen=True)
class Capacity:
    """Per-layer figures of one (tp, cp, micro-batch size, recompute): they do not depend on pp or v.

    work: layers plus embedding and head, in layer units; throughput: layers per ms all the
    groups the nodes can form achieve together; fastest: the least per-layer time of any group.
    """

    work: float
    throughput: float
    fastest: float


def capacity_summary(problem: PlanningProblem, outer: OuterChoice, inventory: Inventory) -> Capacity:
    cache = TermsCache(problem, OuterChoice(outer.tp, 1, outer.micro_batch_size, outer.recompute, cp=outer.cp), 1)
    per_layer = {g: per_layer_ms(cache, g) for g in (inventory.base, *inventory.degraded)}
    throughput = inventory.healthy_base_groups / per_layer[inventory.base]
    for node_class, partitions in zip(inventory.classes, inventory.partitions):
        best = max((sum(1 / per_layer[g] for g in p.groups) for p in partitions), default=0.0)
        throughput += len(node_class.nodes) * best
    sizes = sorted({g.tp for g in per_layer})
    work = problem.workload.model.num_layers + ends_in_layers(cache, sizes)
    return Capacity(work, throughput, min(per_layer.values()))


def bubble_lower_bound_ms(problem: PlanningProblem, outer: OuterChoice, inventory: Inventory, capacity: Capacity, shortest: int) -> float:
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


def simulation_floor_ms(problem: PlanningProblem, outer: OuterChoice, inventory: Inventory, capacity: Capacity,
                         shortest: int, full_backward: bool) -> float:
    """Below the reported (simulated) time of every layout of `outer`, whatever allowed schedule each
    replica runs; the bounds above price the 1F1B bubble model instead, which a zero-bubble schedule beats.

    A stage runs its own ops one at a time, so replica r with m_r microbatches takes at least m_r M_r:
    summed as in `bubble_lower_bound_ms`, T >= N (L + E) / C. The busiest replica runs m >= ceil(N / R)
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


def base_bottleneck_ms(
    problem: PlanningProblem, outer: OuterChoice, cache: TermsCache, stages: int, memo: dict | None = None
) -> float | None:
    """Bottleneck of the base-only template with `stages` stages (None if it does not fit);
    `memo` shares it between outer choices of one search (adjacent pp share lengths)."""
    # What the split reads: stage times (which see the replica counts only through whether pipeline sends
    # stay in a node) and memory caps (through ZeRO's replicas).
    key = (outer.tp, outer.micro_batch_size, outer.recompute, outer.virtual_stages, outer.cp, stages,
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


def strong_lower_bound_ms(
    problem: PlanningProblem, outer: OuterChoice, inventory: Inventory, cache: TermsCache, capacity: Capacity,
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
        bottleneck = base_bottleneck_ms(problem, outer, cache, stages, memo)
        if bottleneck is not None:
            bottlenecks[stages] = bottleneck
    if not bottlenecks:
        return float("inf")
    base_ms = per_layer_ms(cache, inventory.base)
    full = capacity.work * base_ms  # K
    per_group = max(1 / (p * m) for p, m in bottlenecks.items())  # mu

    def credit(stage_type: StageType) -> float:
        if stage_type == inventory.base:
            return per_group
        rho = base_ms / per_layer_ms(cache, stage_type)
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
