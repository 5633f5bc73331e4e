"""Allocation of one outer choice: which TP groups damaged nodes form, which replicas to build,
how many microbatches each runs.

Given the outer choice's templates (pipelines with fixed splits), the
iteration is  P / v + tail,  where P is the busiest replica's (q v - 1) M_t + S_t
(the pipeline budget, v times its time) and the tail is the largest exposed
gradient sync (resharded once replicas differ in sharding) plus the largest
optimizer step, both maxima over the templates used. So the optimum is the
least, over sets A of templates, of

    F(A) + v tail(A),

with F(A) the least budget at which replicas of A alone run all N
microbatches (a feasibility question with no tail in it: every capacity is a
constant at a fixed budget) and tail(A) A's largest sync plus largest
optimizer step. The sets are, per sharding, its templates under a uniform-sync
and an optimizer threshold; and all templates under a resharded-sync and an
optimizer threshold, spanning at least two shardings (an answer found there
that uses one sharding is charged its own, smaller, tail). The templates an
optimal allocation uses lie in the set of their own maxima, so the least over
the sets is exact.

Sets are refined lazily in a priority queue, as the outer search refines its
choices: first keyed by the least budget the LP relaxation allows any
templates, then by their own LP least budget, then settled by CP-SAT
feasibility probes (`allocation_model.py`) from that budget up. The search
stops when no key beats the best allocation found or the incumbent's ceiling.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

from planner.budget import Budget
from planner.nonuniform.allocation.input import (
    TIME_QUANTUM_MS,
    AllocationInput,
    breakpoints_between,
    capacity,
    ticks,
)
from planner.nonuniform.allocation.model import UNKNOWN, FeasibilityModel, Found
from planner.nonuniform.allocation.relaxation import CapacityRelaxation
from planner.work import Work

__all__ = ["TIME_QUANTUM_MS", "Allocation", "AllocationInput", "AllocationSearch", "solve_allocation"]


@dataclass(frozen=True)
class Allocation:
    replicas_per_template: tuple[int, ...]
    microbatches_per_template: tuple[int, ...]
    partition_counts: tuple[tuple[int, ...], ...]  # per class, per partition
    objective_ms: float
    bound_ms: float
    optimal: bool
    status: str


@dataclass(frozen=True)
class _TailSet:
    """Templates an allocation may use, and the tail charged for it (ticks)."""

    members: tuple[int, ...]
    tail: int


@dataclass(frozen=True)
class _Best:
    value: int  # budget + v * tail, in ticks
    budget: int
    found: Found


# Refinement stages of a tail set in the queue.
_ANY_TEMPLATES, _OWN_LP = 0, 1


def _threshold_sets(indices: list[int], sync: list[int], optimizer: list[int], limit: float) -> dict[tuple[int, int], tuple[int, ...]]:
    """Members under each pair of thresholds taken from their own values, keyed by the pair of
    maxima they attain; pairs summing to `limit` or more are left out."""
    out: dict[tuple[int, int], tuple[int, ...]] = {}
    least_optimizer = min(optimizer[k] for k in indices)
    for sync_level in sorted({sync[k] for k in indices}):
        if sync_level + least_optimizer >= limit:
            break
        under = [k for k in indices if sync[k] <= sync_level]
        for optimizer_level in sorted({optimizer[k] for k in under}):
            if sync_level + optimizer_level >= limit:
                break
            members = tuple(k for k in under if optimizer[k] <= optimizer_level)
            out.setdefault((max(sync[k] for k in members), optimizer_level), members)
    return out


class AllocationSearch:
    """The exact allocation of one outer choice, one refinement at a time, with its lower bound
    known throughout: the outer search interleaves many of them, best bound first."""

    def __init__(self, data: AllocationInput, random_seed: int, floor_ms: float = 0.0,
                 ceiling_ms: float = float("inf")) -> None:
        self._data = data
        self._seed = random_seed
        templates, v = data.templates, data.virtual_stages
        self._pieces = data.pieces
        self._single = [p[0] for p in self._pieces] if all(len(p) == 1 for p in self._pieces) else None
        self._uniform = [ticks(t.sync_uniform_ms) for t in templates]
        self._resharded = [max(ticks(t.sync_resharded_ms), u) for t, u in zip(templates, self._uniform)]
        self._optimizer = [ticks(t.optimizer_ms) for t in templates]
        largest_tail = max((r + o for r, o in zip(self._resharded, self._optimizer)), default=0)
        # A known lower bound on the iteration skips budgets below it less the largest tail.
        self._lowest = v * (ticks(floor_ms) - largest_tail)
        self._cutoff = self._limit(ceiling_ms)
        self._relaxation = CapacityRelaxation(data)
        self._model: FeasibilityModel | None = None
        self._queue: list[tuple[int, int, int, int]] | None = None
        self._sets: list[_TailSet] = []
        self._best: _Best | None = None
        self._unsettled: int | None = None  # least key of the sets whose probes ran out of time
        self.settled = 0  # tail sets settled by feasibility probes

    @property
    def data(self) -> AllocationInput:
        return self._data

    @property
    def best_ms(self) -> float:
        """Iteration time of the best allocation found so far, as the search prices it in ticks (inf if none)."""
        return float("inf") if self._best is None else self._best.value * TIME_QUANTUM_MS / self._data.virtual_stages

    def best_floor_ms(self) -> float:
        """`best_ms` less the rounding slack (inf if none): below the best allocation's exact price."""
        if self._best is None:
            return float("inf")
        return (self._best.value - self._slack()) * TIME_QUANTUM_MS / self._data.virtual_stages

    def _limit(self, ceiling_ms: float) -> float:
        """Values at or above this cannot beat `ceiling_ms`; the slack covers the rounding of
        every stage time to ticks (half a tick per microbatch), so no better layout is lost."""
        if ceiling_ms == float("inf"):
            return float("inf")
        return self._data.virtual_stages * ticks(ceiling_ms) + self._slack()

    def _slack(self) -> int:
        return self._data.virtual_stages * (self._data.microbatches + 3)

    def front_ms(self, ceiling_ms: float = float("inf")) -> float:
        """Least iteration an allocation not yet found could have (inf when none beats
        `ceiling_ms` or the best found)."""
        self._cutoff = min(self._cutoff, self._limit(ceiling_ms))
        queue = self._start()
        if not queue or queue[0][0] >= self._bar():
            return float("inf")
        # Less the rounding slack: ticks may overstate the exact figures the caller compares with.
        return (queue[0][0] - self._slack()) * TIME_QUANTUM_MS / self._data.virtual_stages

    def advance(self, time_budget: Budget, ceiling_ms: float = float("inf")) -> None:
        """Refine or settle the set at the front once. A set whose probe ran out of time leaves
        the queue, its key kept as `unsettled_ms`: trying it again could only spin."""
        if self.front_ms(ceiling_ms) == float("inf"):
            return
        key, index, stage, low = heapq.heappop(self._queue)
        if stage == _ANY_TEMPLATES:
            self._refine(key, index, stage, low)
        elif self._settle(self._sets[index], low, time_budget):
            self.settled += 1
        else:
            self._unsettled = key if self._unsettled is None else min(self._unsettled, key)

    @property
    def unsettled_ms(self) -> float | None:
        """Least iteration a set left unsettled (its probe ran out of time) could have; None if none."""
        if self._unsettled is None:
            return None
        return (self._unsettled - self._slack()) * TIME_QUANTUM_MS / self._data.virtual_stages

    def allocation(self) -> Allocation | None:
        """The best allocation found, optimal once nothing left can beat it; None if none
        beats the ceiling."""
        best = self._best
        if best is None or best.value >= self._cutoff:
            return None
        left = min(self._queue[0][0] if self._queue else float("inf"),
                   float("inf") if self._unsettled is None else self._unsettled)
        optimal = left >= best.value
        scale = TIME_QUANTUM_MS / self._data.virtual_stages
        return Allocation(
            replicas_per_template=best.found.replicas,
            microbatches_per_template=_distribute(self._data, best.found, best.budget),
            partition_counts=best.found.partition_counts,
            objective_ms=best.value * scale,
            bound_ms=(best.value if optimal else max(0, left - self._slack())) * scale,
            optimal=optimal,
            status="OPTIMAL" if optimal else "FEASIBLE",
        )

    def solve(self, time_budget: Budget, ceiling_ms: float = float("inf")) -> Allocation | None:
        """The optimal allocation (the best found when `time_budget` runs out), or None if none beats
        `ceiling_ms`."""
        while self.front_ms(ceiling_ms) < float("inf") and not time_budget.expired():
            self.advance(time_budget)
        return self.allocation()

    def _bar(self) -> float:
        return self._cutoff if self._best is None else min(self._cutoff, self._best.value)

    def _capacities(self, budget: int) -> list[int]:
        """`capacity` of every template at once."""
        if self._single is not None:  # the bubble model's one piece each: the hot path of the first pass
            return [max(0, (budget - offset) // slope) for slope, offset in self._single]
        return [capacity(pieces, budget) for pieces in self._pieces]

    def _least_budget(self, members: tuple[int, ...], lowest: float, highest: float) -> int | None:
        """Least breakpoint of the members in [lowest, highest) the relaxations allow."""
        data = self._data
        budgets = breakpoints_between([self._pieces[k] for k in members], data.microbatches, lowest, highest)
        first = bisect.bisect_left(
            range(len(budgets)), True, key=lambda i: self._relaxation.may_run(self._capacities(budgets[i]), members)
        )
        return budgets[first] if first < len(budgets) else None

    def _start(self) -> list[tuple[int, int, int, int]]:
        if self._queue is not None:
            return self._queue
        data, v = self._data, self._data.virtual_stages
        everything = tuple(range(len(data.templates)))
        self._queue = []
        if not everything:
            return self._queue
        least_tail = min(u + o for u, o in zip(self._uniform, self._optimizer))
        low = self._least_budget(everything, self._lowest, self._cutoff - v * least_tail)
        if low is None:
            return self._queue
        # Tails worth charging: the budget cannot go below `low`.
        limit = (self._cutoff - low) / v
        by_sharding: dict[tuple, list[int]] = {}
        for k, template in enumerate(data.templates):
            by_sharding.setdefault(template.sharding, []).append(k)
        # (sharding, or None for mixed ones; sync; optimizer step) -> members.
        sets: dict[tuple, tuple[int, ...]] = {}
        for sharding, members in by_sharding.items():
            for (sync, optimizer), chosen in _threshold_sets(members, self._uniform, self._optimizer, limit).items():
                sets[sharding, sync, optimizer] = chosen
        if len(by_sharding) > 1:
            for (sync, optimizer), chosen in _threshold_sets(list(everything), self._resharded, self._optimizer,
                                                             limit).items():
                if len({data.templates[k].sharding for k in chosen}) > 1:
                    sets[None, sync, optimizer] = chosen
        self._sets = [_TailSet(members, sync + optimizer) for (_, sync, optimizer), members in sets.items()]
        self._queue = [(low + v * s.tail, i, _ANY_TEMPLATES, low) for i, s in enumerate(self._sets)]
        heapq.heapify(self._queue)
        return self._queue

    def _refine(self, key: int, index: int, stage: int, low: int) -> None:
        """A set's key with its own LP least budget (dropped if none beats the bar)."""
        v = self._data.virtual_stages
        tail_set = self._sets[index]
        own = self._least_budget(tail_set.members, low, self._bar() - v * tail_set.tail)
        if own is not None:
            heapq.heappush(self._queue, (own + v * tail_set.tail, index, _OWN_LP, own))

    def _settle(self, tail_set: _TailSet, low: int, time_budget: Budget) -> bool:
        """F(A) by feasibility probes from the LP least budget up; False if time ran out."""
        data, v = self._data, self._data.virtual_stages
        budgets = breakpoints_between([self._pieces[k] for k in tail_set.members], data.microbatches,
                                      low, self._bar() - v * tail_set.tail)
        if not budgets:
            return True
        # The LP least budget is most often feasible; if not, the largest useful one decides
        # whether bisecting between them can pay.
        found = self._probe(budgets[0], tail_set, time_budget)
        if found == UNKNOWN:
            return False
        if found is not None:
            self._offer(budgets[0], found)
            return True
        if len(budgets) == 1:
            return True
        top = self._probe(budgets[-1], tail_set, time_budget)
        if top == UNKNOWN:
            return False
        if top is None:
            return True
        lo, hi, best = 0, len(budgets) - 1, top  # budgets[lo] infeasible, budgets[hi] feasible
        while hi - lo > 1:
            mid = (lo + hi) // 2
            found = self._probe(budgets[mid], tail_set, time_budget)
            if found == UNKNOWN:
                self._offer(budgets[hi], best)
                return False
            if found is None:
                lo = mid
            else:
                hi, best = mid, found
        self._offer(budgets[hi], best)
        return True

    def _probe(self, budget: int, tail_set: _TailSet, time_budget: Budget) -> Found | str | None:
        capacities = self._capacities(budget)
        healthy = self._relaxation.healthy_template(capacities, tail_set.members)
        if healthy is not None:
            k, replicas = healthy
            counts = tuple(tuple(len(c.nodes) if i == 0 else 0 for i in range(len(ps)))
                           for c, ps in zip(self._data.classes, self._data.partitions))
            return Found(tuple(replicas if j == k else 0 for j in range(len(self._data.templates))), counts)
        if self._model is None:
            self._model = FeasibilityModel(self._data, self._seed)
        found = self._model.solve(capacities, tail_set.members, time_budget.remaining_s())
        time_budget.charge(Work.CP_SAT, self._model.deterministic_time)
        time_budget.charge(Work.SMALL_SOLVE)
        return found

    def _tail(self, found: Found) -> int:
        """The tail an allocation actually pays: resharded sync only if its replicas differ in sharding."""
        used = [k for k, n in enumerate(found.replicas) if n > 0]
        mixed = len({self._data.templates[k].sharding for k in used}) > 1
        sync = self._resharded if mixed else self._uniform
        return max(sync[k] for k in used) + max(self._optimizer[k] for k in used)

    def _offer(self, budget: int, found: Found) -> None:
        value = budget + self._data.virtual_stages * self._tail(found)
        if self._best is None or value < self._best.value:
            self._best = _Best(value, budget, found)


def _distribute(data: AllocationInput, found: Found, budget: int) -> tuple[int, ...]:
    """Microbatches per template: each replica one, then fill the fastest templates up to capacity."""
    work = list(found.replicas)
    left = data.microbatches - sum(work)
    order = sorted(range(len(data.templates)), key=lambda k: data.templates[k].bottleneck_ms)
    for k in order:
        room = found.replicas[k] * capacity(data.pieces[k], budget) - work[k]
        take = max(0, min(left, room))
        work[k] += take
        left -= take
    return tuple(work)


def solve_allocation(
    data: AllocationInput,
    time_budget: Budget,
    random_seed: int,
    floor_ms: float = 0.0,
    ceiling_ms: float = float("inf"),
) -> Allocation | None:
    """Optimal allocation, or None if none beats `ceiling_ms` (an incumbent's iteration time).

    `floor_ms`, a known lower bound on the iteration, skips budgets below it less the largest
    tail; budgets whose value cannot beat the ceiling are not tried.
    """
    if not data.templates:
        return None
    return AllocationSearch(data, random_seed, floor_ms, ceiling_ms).solve(time_budget)
