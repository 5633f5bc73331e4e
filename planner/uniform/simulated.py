"""The stock uniform space searched for the number a plan reports: its simulated iteration time.

With `allow_non_uniform: false` (stock layouts) a plan's `predicted.iteration_time_s` is the chosen
schedule's simulated makespan plus the gradient sync it leaves exposed and the optimizer step, the
schedule being the fastest allowed handcrafted one that fits memory (`planner.schedules.for_plan`). This
search minimizes exactly that, by branch and bound:

* Every shape (`ranked_candidates`) starts with `simulation_floor_ms`: m times its bottleneck stage's
  least time plus the sync floors, below the simulated time of every split and every schedule.
* Popped, a shape's bound is refined to the least, over every stock split that fits memory (first and
  last stage free, middle stages equal), of `planner.schedules.bounds.lower_bound_ms` (valid for every
  schedule of the allowed families: with only full-backward ones, GPipe, 1F1B and interleaved, the
  tighter full-backward form) plus that split's sync and optimizer, at full speed.
* Popped, a split's placements of degraded groups (`planner.uniform.placements`: which replica, which
  stage position) are bounded each, and queued.
* Then placements are simulated in the order of their bounds, each with every allowed handcrafted
  schedule, until the next bound is no better than the best simulated plan; a placement no stock
  launcher can start (`planner.uniform.launch`) is dropped.

Where looped BFS is allowed, chunked shapes' sync terms count only what it must leave exposed
(`planner.schedules.sync`). The search stops when no bound in the queue beats the incumbent, so
`objective_ms` is optimal over the stock space (every shape, every stock split, every placement of the
degraded groups a launcher starts, every allowed handcrafted schedule) under the simulator, and
`bound_ms` is below every layout of it whichever allowed schedule runs it, CP-SAT's `optimized`
included when allowed. Budget cuts leave the least bound still queued as the bound; splits with more
placements than `PlannerConfig.max_slow_placements` keep their split bound for those not tried.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace
from itertools import count

from cost_models.choices import ScheduleName
from cost_models.iteration import StageTime, iteration_of_stages, stage_time
from cost_models.pipeline import pipeline_time_ms
from planner.assemble import stage_figures, stage_grad_sync
from planner.budget import Budget
from planner.problem import PlanningProblem
from planner.result import ReplicaResult, StageResult
from planner.schedules.bounds import full_backward_only, lower_bound_ms
from planner.schedules.build import replica_spec
from planner.schedules.choose import best_run
from planner.schedules.handcrafted import handcrafted_names, handcrafted_schedule
from planner.schedules.ops import PipelineSpec, Schedule
from planner.schedules.simulator import simulate, validate
from planner.uniform.candidates import Candidate, LowerBounds, ranked_candidates, simulation_floor_ms
from planner.uniform.launch import placement_grid
from planner.uniform.placements import (
    Placement,
    degraded_speeds_used,
    placements,
    slowest_anywhere,
)
from planner.uniform.search import SearchResult, evaluate
from planner.work import Work

_FLOOR, _SPLITS, _PLACEMENTS, _RESIDUAL = 0, 1, 2, 3


def stock_splits(layers: int, pp: int, caps: tuple[int, ...], virtual_stages: int):
    """Every split stock frameworks run, within the per-stage layer caps: any first and last stage,
    equal middle stages; equal stages with interleaving (each cut into v chunks)."""
    if virtual_stages > 1:
        if layers % (pp * virtual_stages) == 0 and all(layers // pp <= cap for cap in caps):
            yield (layers // pp,) * pp
        return
    if pp == 1:
        if layers <= caps[0]:
            yield (layers,)
        return
    middle_cap = min(caps[1:-1], default=layers)
    for middle in range(1, middle_cap + 1) if pp > 2 else (0,):
        ends = layers - middle * (pp - 2)
        for first in range(max(1, ends - caps[-1]), min(caps[0], ends - 1) + 1):
            yield (first, *([middle] * (pp - 2)), ends - first)


@dataclass(frozen=True)
class _Replica:
    """One replica speed vector of a split: its pipeline and its bubble-model figures."""

    spec: PipelineSpec
    bubble_ms: float  # the bubble model's pipeline time
    iteration_ms: float  # the bubble model's iteration time (pipeline, sync, optimizer)


class StockSearch:
    def __init__(self, problem: PlanningProblem, budget: Budget,
                 ranked: tuple[list[Candidate], bool] | None = None) -> None:
        """`ranked`, `ranked_candidates(problem, ...)` when the caller has them already."""
        self._problem = problem
        self._started = time.monotonic()
        self._candidates, complete = ranked if ranked is not None else ranked_candidates(problem, budget)
        allowed = problem.allowed_schedules
        self._names = allowed  # None: every schedule
        self._split_backward = not full_backward_only(allowed)
        # Looped BFS hides finished chunks' gradient sync (`planner.schedules.sync`): bounds on chunked shapes
        # may then count only the least last bucket.
        self._chunk_sync_overlap = allowed is None or ScheduleName.LOOPED_BFS in allowed
        self._orders: dict[tuple, Schedule] = {}
        self._placed: dict[int, tuple[list[Placement], bool, tuple[float, ...]]] = {}
        self._makespans: dict[tuple, float] = {}  # (index, split, speed vector): its best handcrafted run
        self._launch: dict[tuple, bool] = {}  # (tp, pp, dp, placement): whether launchers can start it
        self._stages: dict[tuple, tuple[StageResult, StageTime]] = {}  # (shape, position, layers, speed)
        self._tie = count()
        layers = problem.workload.model.num_layers
        bounds = LowerBounds(problem)
        self._queue = [(simulation_floor_ms(c, layers, full_backward=not self._split_backward,
                                            chunk_sync_overlap=self._overlaps_chunks(c), bounds=bounds),
                        next(self._tie), _FLOOR, i, None)
                       for i, c in enumerate(self._candidates)]
        heapq.heapify(self._queue)
        budget.charge(Work.STOCK_FLOOR, len(self._queue))
        self._cut_bound = float("inf") if complete else 0.0  # shapes left uncosted are not bounded here
        self._residual_bound = float("inf")  # placements of splits too many to enumerate
        self._best: tuple[float, int, tuple[int, ...], Placement] | None = None
        self._solved = 0
        self._units = 0  # splits and placements bounded and simulated: the work `run(max_units=...)` counts
        self._ops = 0  # timeline ops simulated

    @property
    def best_ms(self) -> float:
        return self._best[0] if self._best is not None else float("inf")

    def next_bound_ms(self) -> float:
        return self._queue[0][0] if self._queue else float("inf")

    def run(self, budget: Budget, *, until_a_layout: bool = True, max_units: int | None = None,
            incumbent_ms: float = float("inf")) -> None:
        """Refine and simulate until nothing queued beats the best layout (or `incumbent_ms`, a layout the
        caller has) or the budget ends; past the deadline only until there is a first layout, unless
        `until_a_layout` is off (the caller has one). `max_units` also ends it, counted in splits and
        placements bounded and simulated: the same on any machine."""
        tolerance = self._problem.config.prune_tolerance
        while self._queue and self.next_bound_ms() < min(self.best_ms, incumbent_ms) * (1 - tolerance):
            if (self._best is not None or not until_a_layout) and budget.expired():
                return
            if max_units is not None and self._units >= max_units and (self._best is not None or not until_a_layout):
                return
            bound, _, stage, index, payload = heapq.heappop(self._queue)
            units, ops = self._units, self._ops
            if stage == _FLOOR:
                self._refine(index)
            elif stage == _SPLITS:
                self._expand_next(bound, index, payload)
            elif stage == _PLACEMENTS:
                self._simulate_next(bound, index, payload)
            else:  # placements never enumerated: their bound stands
                self._residual_bound = min(self._residual_bound, bound)
            budget.charge(Work.TIMELINE_OP, self._ops - ops)
            budget.charge(Work.STOCK_UNIT, self._units - units)

    def _placements(self, index: int) -> tuple[list[Placement], bool, tuple[float, ...]]:
        """The shape's placements of degraded groups, whether that is all of them, and their speeds."""
        if index not in self._placed:
            shape = self._candidates[index].shape
            speeds = degraded_speeds_used(self._candidates[index].inventory, shape.pp, shape.dp)
            found, complete = placements(speeds, shape.pp, shape.dp, self._problem.config.max_slow_placements)
            if shape.expert_replicas > 1:  # replicas sharing experts run at their group's pace
                found = [replace(placement, ep=shape.expert_replicas) for placement in found]
            self._placed[index] = (found, complete, speeds)
        return self._placed[index]

    def _refine(self, index: int) -> None:
        """Every fitting stock split of the shape with a bound below all its placements, best first,
        queued at the first."""
        problem, candidate = self._problem, self._candidates[index]
        shape = candidate.shape
        caps = candidate.max_layers(problem.usable_memory_bytes)
        priced = [(self._split_bound(candidate, split), split)
                  for split in stock_splits(problem.workload.model.num_layers, shape.pp, caps, shape.virtual_stages)]
        self._units += max(1, len(priced))
        if not priced:
            return
        self._solved += 1
        priced.sort()
        heapq.heappush(self._queue, (priced[0][0], next(self._tie), _SPLITS, index, priced))

    def _expand_next(self, bound_ms: float, index: int, priced: list) -> None:
        """The best-bounded split's placements, each with its own bound, queued; those left out of the
        enumeration keep the split's bound (`_RESIDUAL`)."""
        _, split = priced.pop(0)
        if priced:
            heapq.heappush(self._queue, (max(bound_ms, priced[0][0]), next(self._tie), _SPLITS, index, priced))
        candidate = self._candidates[index]
        found, complete, _ = self._placements(index)
        replicas: dict[tuple[float, ...], _Replica] = {}
        ranked = sorted((max(bound_ms, self._placement_bound(candidate, split, placement, replicas)), placement)
                        for placement in found)
        self._units += len(ranked) - 1
        heapq.heappush(self._queue, (ranked[0][0], next(self._tie), _PLACEMENTS, index, (split, ranked)))
        if not complete:
            residual_ms = max(bound_ms, self._anywhere_bound(candidate, split))
            heapq.heappush(self._queue, (residual_ms, next(self._tie), _RESIDUAL, index, None))

    def _simulate_next(self, bound_ms: float, index: int, payload: tuple) -> None:
        split, ranked = payload
        _, placement = ranked.pop(0)
        self._units += 1
        if self._launchable(index, placement):
            value = self._value(self._candidates[index], index, split, placement)
            if value < self.best_ms:
                self._best = (value, index, split, placement)
        if ranked:
            heapq.heappush(self._queue, (max(bound_ms, ranked[0][0]), next(self._tie), _PLACEMENTS, index,
                                         (split, ranked)))

    def _launchable(self, index: int, placement: Placement) -> bool:
        """Whether stock launchers can start the placement: every node one block of ranks (`launch_grid`)."""
        if not placement.slow_rows:  # full-speed groups only: nodes one after another always launch
            return True
        shape = self._candidates[index].shape
        key = (shape.group_size, shape.pp, shape.dp, placement)
        if key not in self._launch:
            self._launch[key] = placement_grid(self._problem, shape.group_size, shape.pp, shape.dp, placement) is not None
        return self._launch[key]

    def _replica(self, candidate: Candidate, split: tuple[int, ...], speeds: tuple[float, ...]) -> _Replica:
        terms, v = candidate.terms, candidate.shape.virtual_stages
        stages = tuple(self._stage(candidate, i, n, speed) for i, (n, speed) in enumerate(zip(split, speeds)))
        replica = ReplicaResult(id=0, num_microbatches=terms.num_microbatches, stages=tuple(s for s, _ in stages))
        spec = replica_spec(replica, v, self._problem.usable_memory_gib)
        bubble = pipeline_time_ms([s.forward_ms + s.backward_ms for s, _ in stages], terms.num_microbatches, v)
        healthy = [self._stage(candidate, i, n, 1.0)[1] for i, n in enumerate(split)]
        return _Replica(spec, bubble, iteration_of_stages(terms, [t for _, t in stages], healthy).iteration_ms)

    def _stage(self, candidate: Candidate, position: int, layers: int, speed: float) -> tuple[StageResult, StageTime]:
        """A stage of the shape as a plan reports it, and its timing; splits of one shape share most stages
        (stock splits differ only at the ends), so each is costed once."""
        key = (candidate.shape, position, layers, speed)
        if key not in self._stages:
            terms = candidate.terms
            timing = stage_time(terms, position, layers, speed)
            # Only a schedule that hides finished chunks' sync reads it (looped BFS): skip it where none can run.
            grad_sync = stage_grad_sync(terms, position, layers) if self._overlaps_chunks(candidate) else None
            self._stages[key] = (StageResult(id=position, layers=(0, 0), devices=(), tp=candidate.shape.tp, speed=speed,
                                             grad_sync=grad_sync, **stage_figures(timing)), timing)
        return self._stages[key]

    def _overlaps_chunks(self, candidate: Candidate) -> bool:
        return self._chunk_sync_overlap and candidate.shape.virtual_stages > 1

    def _bound(self, replicas: list[_Replica]) -> float:
        """Below the reported time of a layout whose replicas are these, under every allowed schedule
        (`_value`'s form; with one replica, below every layout holding one at least as slow). A schedule
        hiding finished chunks' sync (looped BFS) leaves at least the least last bucket exposed
        (`planner.schedules.sync`: the stage ending last still sends one after its end)."""
        tail = max(r.iteration_ms for r in replicas) - max(r.bubble_ms for r in replicas)
        return tail + max(lower_bound_ms(r.spec, split_backward=self._split_backward) - self._sync_relief_ms(r.spec)
                          for r in replicas)

    def _sync_relief_ms(self, spec: PipelineSpec) -> float:
        """How far below the 1F1B sync price a run of `spec` may report (0 without looped BFS)."""
        if not (self._chunk_sync_overlap and spec.virtual_stages > 1 and spec.grad_sync):
            return 0.0
        # The stage whose reduction ends last leaves at least its last bucket and its weight all-gather exposed.
        least_ms = min(s.last_bucket_ms for s in spec.grad_sync) + min(s.gather_exposed_ms for s in spec.grad_sync)
        return max(0.0, max(s.exposed_ms for s in spec.grad_sync) - least_ms)

    def _split_bound(self, candidate: Candidate, split: tuple[int, ...]) -> float:
        """Below the reported time of this split under every placement and allowed schedule: a replica at
        full speed (one replica, as cheap as a healthy split; the placements get their own bounds once
        the split is popped). Less the stage figures' rounding: a plan's tail (its iteration less its pipeline)
        differs by it between replicas of other speeds, each op time rounded to 1e-3 ms on the wire."""
        shape = candidate.shape
        rounding_ms = 1e-3 * (candidate.terms.num_microbatches * shape.virtual_stages + shape.pp)
        return self._bound([self._replica(candidate, split, (1.0,) * shape.pp)]) - rounding_ms

    def _anywhere_bound(self, candidate: Candidate, split: tuple[int, ...]) -> float:
        """Below the reported time of this split under every placement: some replica holds the slowest
        used group somewhere, and is at least as slow as that group alone there (for the placements
        beyond the enumeration)."""
        shape = candidate.shape
        speeds = degraded_speeds_used(candidate.inventory, shape.pp, shape.dp)
        if not speeds:
            return self._split_bound(candidate, split)
        return min(self._bound([self._replica(candidate, split, vector)]) for vector in slowest_anywhere(speeds, shape.pp))

    def _placement_bound(self, candidate: Candidate, split: tuple[int, ...], placement: Placement,
                         replicas: dict[tuple[float, ...], _Replica] | None = None) -> float:
        """Below the reported time of this split and placement under every allowed schedule; `replicas`
        caches the speed vectors the split's placements share."""
        replicas = {} if replicas is None else replicas
        for vector in placement.distinct:
            if vector not in replicas:
                replicas[vector] = self._replica(candidate, split, vector)
        return self._bound([replicas[vector] for vector in placement.distinct])

    def _value(self, candidate: Candidate, index: int, split: tuple[int, ...], placement: Placement) -> float:
        """The iteration time a plan of this split and placement reports (`for_plan._apply`): the
        bubble-model iteration, moved by how much the slowest replica's handcrafted schedule (`best_run`:
        the fastest that fits, as `choose_schedule` picks) differs from the bubble model, its makespan and
        its sync (`SimulationResult.reported_ms`); infinite when no allowed schedule fits memory."""
        replicas = [self._replica(candidate, split, vector) for vector in placement.distinct]
        makespans = []
        for vector, replica in zip(placement.distinct, replicas):
            key = (index, split, vector)
            if key not in self._makespans:
                orders = self._orders_for(replica.spec)
                runs = [(order, simulate(order, replica.spec, validated=True)) for order in orders]
                self._ops += sum(order.op_count for order in orders)
                best = best_run(runs, replica.spec)[1]
                # No allowed schedule fits (memory caps assume 1F1B's in-flight count; GPipe and looped BFS
                # hold every microbatch): the split does not run.
                self._makespans[key] = float("inf") if best.over_memory(replica.spec) else best.reported_ms
            makespans.append(self._makespans[key])
        return max(r.iteration_ms for r in replicas) - max(r.bubble_ms for r in replicas) + max(makespans)

    def _orders_for(self, spec: PipelineSpec) -> list[Schedule]:
        """The allowed handcrafted orders; all of them when none is allowed (`optimized` alone: they are
        what CP-SAT starts from, and the plan's schedule is then at least as fast)."""
        names = handcrafted_names(spec.virtual_stages)
        if self._names is not None and any(name in self._names for name in names):
            names = tuple(name for name in names if name in self._names)
        out = []
        for name in names:
            key = (name, spec.num_stages, spec.num_microbatches, spec.virtual_stages)
            if key not in self._orders:
                self._orders[key] = handcrafted_schedule(name, *key[1:])
                validate(self._orders[key], spec)
            out.append(self._orders[key])
        return out

    def finished(self, incumbent_ms: float = float("inf")) -> bool:
        """Whether no bound left in the queue beats the best layout (or the caller's, `incumbent_ms`): the
        search has proven it."""
        least = min(self.next_bound_ms(), self._residual_bound)
        return least >= min(self.best_ms, incumbent_ms) * (1 - self._problem.config.prune_tolerance) and self._cut_bound > 0

    def result(self) -> tuple[SearchResult, float] | None:
        """The best layout (its SearchResult carries the bubble-model figures the plan is assembled
        from) and the bound on the reported time over everything not excluded."""
        if self._best is None:
            return None
        value, index, split, placement = self._best
        candidate = self._candidates[index]
        bound = min(value, self._cut_bound, self.next_bound_ms(), self._residual_bound)
        optimal = bound >= value * (1 - self._problem.config.prune_tolerance)
        estimate = evaluate(candidate, split, placement.distinct)
        found = SearchResult(
            candidate=candidate, layers_per_stage=split, estimate=estimate, objective_ms=estimate.iteration_ms,
            placement=placement,
            bound_ms=estimate.iteration_ms, optimal=optimal, wall_time_s=time.monotonic() - self._started,
            candidates_total=len(self._candidates), candidates_solved=self._solved,
        )
        return found, (value if optimal else bound)
