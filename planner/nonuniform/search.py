"""Failure-aware search over non-uniform layouts: outer branch and bound, CP-SAT allocation inside.

Outer choices (base TP size, context-parallel size, stage count, micro-batch size, recompute,
chunks) are ordered by a lower bound valid for every layout they allow
(`planner.nonuniform.outer_bounds`). For each outer choice whose bound can
still beat the incumbent, templates are built and CP-SAT allocates them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, replace

from cost_models.context_parallel import load_balanced_chunks
from cost_models.resharding import nonuniform_iteration_ms
from planner.budget import Budget
from planner.config import TIME_QUANTUM_MS, PlannerConfig
from planner.nonuniform.allocation.input import need
from planner.nonuniform.allocation.search import (
    Allocation,
    AllocationInput,
    AllocationSearch,
)
from planner.nonuniform.outer_bounds import (
    Capacity,
    Inventory,
    bubble_lower_bound_ms,
    build_inventory,
    capacity_summary,
    simulation_floor_ms,
    strong_lower_bound_ms,
)
from planner.nonuniform.partitions import NodeClass, Partition
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
from planner.uniform.candidates import context_parallel_sizes, split_sequences_win, tensor_parallel_sizes
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


def _memory_replicas(problem: PlanningProblem, outer: OuterChoice, inventory: Inventory) -> int:
    """Replicas ZeRO-1 memory is computed for; the allocation must build at least this many."""
    if problem.workload.zero_stage < 1:
        return 1
    microbatches = problem.workload.global_batch_size // outer.micro_batch_size
    return max(1, min(microbatches, inventory.healthy_base_groups // outer.pp))


def _link_replicas(outer: OuterChoice, inventory: Inventory, config: PlannerConfig) -> int:
    """The most replicas an outer choice can build: gradient sync and pipeline links are costed
    for this many during the search (more replicas never make either cheaper)."""
    return max(1, inventory.group_count_bound() // pipeline_lengths(outer.pp, config)[0])


def nonuniform_context_parallel_sizes(problem: PlanningProblem, tp: int) -> list[int]:
    """CP sizes the failure-aware search tries with base TP size `tp`: those of the uniform search
    (`context_parallel_sizes`) whose stage group of tp x cp GPUs fits in one node, where damaged nodes can
    still form it. Groups spanning nodes stay with stock layouts, which take undamaged nodes for them."""
    return [cp for cp in context_parallel_sizes(problem, tp) if tp * cp <= problem.cluster.gpus_per_node]


def outer_choices(problem: PlanningProblem) -> list[OuterChoice]:
    layers = problem.workload.model.num_layers
    batch = problem.workload.global_batch_size
    out = []
    for tp in tensor_parallel_sizes(problem):
        for cp in nonuniform_context_parallel_sizes(problem, tp):
            for mbs in problem.micro_batch_sizes:
                # As in the uniform search (`split_sequences_win`): cp ranks on a micro-batch that cp whole
                # sequences fill lose to cp replicas of mbs / cp sequences on the same GPUs, which the
                # allocation of the cp = 1 outer choice can build replica for replica.
                if batch % mbs or split_sequences_win(problem, cp, mbs):
                    continue
                for pp in range(1, layers + 1):
                    chunks = [1] + [v for v in range(2, problem.config.max_virtual_stages + 1) if pp >= 2 and layers % v == 0 and layers // v >= pp]
                    for v in filter(problem.allows_virtual_stages, chunks):
                        for recompute in problem.recompute_modes:
                            out.append(OuterChoice(tp, pp, mbs, recompute, v, cp))
    return out


def _inventories(problem: PlanningProblem) -> dict[tuple[int, int], Inventory]:
    """Per (base TP size, CP size), the stage groups the nodes can form; smaller TP sizes serve as degraded
    groups where the sequence still cuts into their CP chunks."""
    sizes = tensor_parallel_sizes(problem)
    seq = problem.workload.seq_length
    return {(tp, cp): build_inventory(problem, tp, [s for s in sizes if cp == 1 or load_balanced_chunks(seq, cp, s)], cp)
            for tp in sizes for cp in nonuniform_context_parallel_sizes(problem, tp)}


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
        self._values: dict[tuple, float] = {}  # layouts valued, by `_valuation_key`
        self._full_backward = full_backward_only(problem.allowed_schedules)
        self._best_value = float("inf")
        # Least floor of an outer choice left with its floor-optimal allocation valued above that floor:
        # another of its allocations could still lie between the two.
        self._residual_ms = float("inf")
        self._pieces: dict[tuple[int, int], tuple[Template, tuple]] = {}  # the template kept: its id stays its own
        # What does not depend on the pricing is kept in `caches`, which two searches of one problem share.
        caches = {} if caches is None else caches
        if "inventories" not in caches:
            caches["inventories"] = _inventories(problem)
        self._inventories: dict[tuple[int, int], Inventory] = caches["inventories"]
        self._capacities: dict[tuple[int, int, int, str], Capacity] = caches.setdefault("capacities", {})
        self._bottlenecks: dict[tuple, float | None] = caches.setdefault("bottlenecks", {})
        # Memory caps and stage times shared by every TermsCache, and templates shared by outer choices.
        self._shared: dict = caches.setdefault("terms", {})
        self._template_memo: dict[tuple, Template | None] = caches.setdefault("templates", {})
        self._built: dict[int, list[Template]] = {}
        self._searches: dict[int, AllocationSearch] = {}
        self._queue = self._initial_queue(budget or Budget.unlimited())
        # Outer choices whose allocation floor beats the best layout wait here and are refined before the queue
        # (a dive; see `step`).
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
            inventory = self._inventories[(outer.tp, outer.cp)]
            if pipeline_lengths(outer.pp, problem.config)[0] > inventory.group_count_bound():
                continue  # not even the shortest allowed pipeline finds enough TP groups
            key = (outer.tp, outer.cp, outer.micro_batch_size, outer.recompute)
            if key not in self._capacities:
                self._capacities[key] = capacity_summary(problem, outer, inventory)
            # The shortest allowed length keeps this bound valid whatever fits; whether anything
            # fits memory is checked when the outer choice reaches the front of the queue.
            shortest = pipeline_lengths(outer.pp, problem.config)[0]
            if self._value_of is not None:
                bound = simulation_floor_ms(problem, outer, inventory, self._capacities[key], shortest, self._full_backward)
            else:
                bound = bubble_lower_bound_ms(problem, outer, inventory, self._capacities[key], shortest)
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

        An outer choice whose allocations could still beat the best layout is refined before the queue's front,
        until it is settled or no longer can (a dive, as branch-and-bound solvers dive for incumbents): floors and
        bubble-model bounds sit 10-25% below the reported times at 256 GPUs, so best-bound order spends most steps
        raising the bound over thousands of outer choices before it settles the allocation that beats the answer
        (pass 1 took 10% less CPU over the 44 256-GPU failure scenarios diving, with its `bubble_search_gap`). The
        order changes; what each bound covers does not (`next_bound_ms` is the least of both queues)."""
        problem = self._problem
        best_ms = min(incumbent_ms, self.best_ms)
        lower, index, stage, outer = heapq.heappop(self._dives if self._dives else self._queue)
        inventory = self._inventories[(outer.tp, outer.cp)]
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
            capacity = self._capacities[(outer.tp, outer.cp, outer.micro_batch_size, outer.recompute)]
            tighter = max(lower, strong_lower_bound_ms(problem, outer, inventory, cache, capacity, self._bottlenecks,
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
            heapq.heappush(self._dives, (max(lower, front), index, _BOUNDED, outer))
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

    def _offer(self, outer: OuterChoice, inventory: Inventory, allocation_search: AllocationSearch,
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
        elif (key := _valuation_key(layout)) in self._values:
            value = self._values[key]
        else:
            value, steps = self._value_of(layout)
            self.valuing_steps += steps
            self._values[key] = value
        if value < best_ms:
            self._best, self._best_value = layout, value


def _valuation_key(layout: NonUniformLayout) -> tuple:
    """What a layout's reported time depends on once recosted for its own replicas (`recost`): not the nominal pp,
    nor the replica counts the search costed its templates for, so outer choices that share templates (pp 11 to 14
    all build the same three-stage pipelines) find the same layout again, and it is valued once."""
    outer, allocation = layout.outer, layout.allocation
    used = tuple((t.stage_types, t.layers_per_stage, count, work) for t, count, work in zip(
        layout.templates, allocation.replicas_per_template, allocation.microbatches_per_template) if count)
    return (outer.tp, outer.cp, outer.micro_batch_size, outer.recompute, outer.virtual_stages, used,
            allocation.partition_counts)


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
