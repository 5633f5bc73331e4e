"""Planner entry points: problem in, plan out.

With `stock_layouts_only`, `plan` runs the stock search (`uniform/simulated.py`), exact for the
simulated time a plan reports. Otherwise (failure-aware) it runs the uniform and non-uniform
bubble-model searches (`uniform/search.py`, `nonuniform/`), interleaved by bound with one shared
incumbent, and the stock search beside them; each layout found gets its simulated schedules and the
answer is the one whose reported time is least, so a failure-aware plan is never slower than the stock
plan. Every solver report is in the reported number (`reported.py`): objective = 1000 x
`predicted.iteration_time_s`, and the bound holds for that number.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from cost_models.choices import ScheduleName
from planner.assemble import assemble_plan, finish_plan
from planner.budget import Budget
from planner.config import DEFAULT_CONFIG, PlannerConfig
from planner.deadline import finish_reserve_s, ops_cost_s, setup_s
from planner.errors import InfeasibleError
from planner.gc_pause import gc_paused
from planner.infeasibility import explain_infeasible, obvious_infeasibility
from planner.nonuniform.assemble import assemble_replicas, breakdown_s, recost
from planner.nonuniform.search import (
    NonUniformLayout,
    NonUniformResult,
    NonUniformSearch,
    search_nonuniform,
)
from planner.problem import PlanningProblem
from planner.result import PlanResult, SolverResult
from planner.schedules.for_plan import (
    handcrafted_cost_s,
    handcrafted_ops,
    handcrafted_reported_ms,
    reported_floor_ms,
    with_schedules,
)
from planner.uniform.search import SearchResult, UniformSearch, search
from planner.uniform.candidates import Candidate, ranked_candidates
from planner.uniform.simulated import StockSearch
from planner.reported import SEARCH_FINISHED, WALL_CLOCK_STOP, WORK_BUDGET_STOP, as_reported
from planner.zero_choice import plan_each_zero_stage
from planner.work import Work



def schedule_budget_s(total_s: float, config: PlannerConfig = DEFAULT_CONFIG) -> float:
    """What the schedule step is kept of an answer's `total_s` seconds."""
    return min(config.max_optimize_s_per_replica, config.schedule_time_share * total_s)


def schedule_time_s(total_s: float, left_s: float, config: PlannerConfig = DEFAULT_CONFIG) -> float:
    """The schedule step's time: its budget, or what the layout search left of the `total_s` when
    that is more (a search that finished early leaves time for list schedules), never more than one
    CP-SAT schedule's cap and never past the deadline."""
    return min(max(schedule_budget_s(total_s, config), left_s), config.max_optimize_s_per_replica, max(0.0, left_s))


def plan_uniform(problem: PlanningProblem, budget: Budget | None = None) -> PlanResult:
    """The best uniform layout on the healthy devices under the cost model, with its schedule. Stock
    layouts (`stock_layouts_only`) are searched for the simulated time the plan reports
    (`planner.uniform.simulated`); other uniform spaces for the bubble model (`planner.uniform.search`)."""
    budget = budget or Budget.starting_now(problem.time_limit_s)
    if not problem.stock_layouts_only:
        return _within_time_limit(problem, budget, lambda layout_budget: assemble_plan(problem, search(problem, layout_budget)))
    result = _within_time_limit(problem, budget, lambda layout_budget: _stock_layout(problem, layout_budget))
    return as_reported(problem, result, result.solver.bound_ms, exact_search=True)


def _stock_layout(problem: PlanningProblem, budget: Budget) -> PlanResult:
    """The stock search's layout, assembled; its solver report carries the bound on reported times."""
    stock = StockSearch(problem, budget)
    stock.run(budget)
    found = stock.result()
    if found is None:
        raise InfeasibleError(explain_infeasible(problem))
    layout, bound_ms = found
    result = assemble_plan(problem, layout)
    return replace(result, solver=replace(result.solver, bound_ms=round(bound_ms, 3)))


@gc_paused()
def plan(problem: PlanningProblem, budget: Budget | None = None) -> PlanResult:
    """The best layout for the cluster as it is now (uniform only when `stock_layouts_only`), by the
    deadline of `budget` (default: `time_limit_s` from now), counted in work (`Budget.as_work`)."""
    budget = (budget or Budget.starting_now(problem.time_limit_s)).as_work()
    if problem.zero_stage_auto:
        return plan_each_zero_stage(problem, budget, plan)
    obvious = obvious_infeasibility(problem)
    if obvious is not None:
        raise InfeasibleError(obvious)
    if problem.stock_layouts_only:
        return plan_uniform(problem, budget)
    return _plan_failure_aware(problem, budget)


def _plan_failure_aware(problem: PlanningProblem, budget: Budget) -> PlanResult:
    """The least reported time of three passes, reported against a bound on the reported time of every
    layout in the failure-aware space (`stock` and non-uniform template layouts; see README, "What a plan
    decides"):

    1. the bubble-model searches (uniform with any contiguous split, and non-uniform, by bound with one
       incumbent): fast to prove within their own model, which 1F1B's simulation never exceeds;
    2. the stock search, exact for reported times over stock layouts, which the failure-aware space holds:
       the answer is never slower than `allow_non_uniform: false` would give on the same budget;
    3. the non-uniform search again, every template priced by its simulation floor under the allowed
       schedules (`floor_pieces`) and every allocation it finds valued by simulating its handcrafted
       schedules, with the best time so far as incumbent: its bound holds for reported times.

    Layouts of pass 1 outside the two spaces (uniform ones with splits of other forms) are answers, not
    part of the proof."""
    started = time.monotonic()
    work = budget.as_work()
    total_s = work.remaining_s()
    layout_budget = work.less(schedule_budget_s(total_s, problem.config) + finish_reserve_s(problem))
    # What the checking passes may plan on, estimated without looking at a clock: the layout time less the
    # setup (`planner.deadline`), beyond pass 1's share.
    checking_s = max(0.0, layout_budget.remaining_s() - setup_s(problem)) * (1 - problem.config.bubble_search_share)
    ranked = ranked_candidates(problem, layout_budget)
    caches: dict = {}  # templates and stage costs, shared by the two non-uniform searches
    steps: list[int] = []
    try:
        layout = _plan_layout(problem, layout_budget.share(problem.config.bubble_search_share), ranked, caches, steps)
    except InfeasibleError:
        layout = None
    # The checking passes below are sized by the refinements the first made, counted, not timed, so that
    # a loaded machine gives the same answer; the time limit stays the safety net. Past the deadline the
    # stock search goes on only while there is no layout at all.
    config = problem.config
    stock_units = max(config.min_checking_units, config.stock_units_per_step * len(steps))
    floor_steps = max(config.min_checking_units, config.floor_steps_per_step * len(steps))
    # Where the layout time pass 1 leaves by its share (not what it happened to use: that would depend on the
    # machine's load) may not hold that much work at `checking_unit_s`, it is cut in quarters; with none left
    # (a short limit at scale) the others only bound the answer. The time limit stays the safety net.
    if layout is not None:
        left_s = checking_s - handcrafted_cost_s(problem, layout)
        level = min(1.0, math.floor(4 * left_s / (config.checking_unit_s * (stock_units + floor_steps))) / 4)
        stock_units, floor_steps = int(max(0.0, level) * stock_units), int(max(0.0, level) * floor_steps)
    hurried = layout is not None and floor_steps == 0
    # Candidates are compared by their handcrafted schedules (what every search values layouts by); only
    # the answer is given list and CP-SAT schedules.
    candidates: list[tuple[float, PlanResult]] = []
    if layout is not None:
        candidates.append((0.0 if hurried else _valued(problem, layout, layout_budget), layout))
    stock = StockSearch(problem, layout_budget, ranked)
    # Stock layouts bounded above pass 1's layout cannot win: their bound is the stock space's.
    pass_one_ms = candidates[0][0] if candidates and not hurried else float("inf")
    if not hurried:
        stock.run(layout_budget, until_a_layout=layout is None, max_units=stock_units, incumbent_ms=pass_one_ms)
    found = stock.result()
    if found is not None:
        candidates.append((stock.best_ms, assemble_plan(problem, found[0])))
    if not candidates:
        raise InfeasibleError(explain_infeasible(problem))
    incumbent_ms = min(value for value, _ in candidates)
    simulated = search_nonuniform(problem, incumbent_ms, layout_budget, max_steps=0 if hurried else floor_steps,
                                  value_of=lambda found: _valued_in_steps(problem, nonuniform_plan(problem, found), layout_budget),
                                  caches=caches)
    if simulated.layout is not None and simulated.layout_value_ms < incumbent_ms:
        candidates.append((simulated.layout_value_ms, nonuniform_plan(problem, simulated.layout)))
    answer = _best_scheduled(problem, candidates, work, total_s)
    searched = layout.solver if layout is not None else answer.solver
    finished = simulated.exhausted and stock.finished(pass_one_ms)
    solver = replace(answer.solver, wall_time_s=round(time.monotonic() - started, 3),
                     candidates_total=searched.candidates_total + simulated.outer_total,
                     candidates_solved=searched.candidates_solved + simulated.outer_solved,
                     stopped_by=WALL_CLOCK_STOP if work.wall_led else (SEARCH_FINISHED if finished else WORK_BUDGET_STOP))
    # Below every stock layout, and every non-uniform one the simulation-floor search did not value.
    stock_bound_ms = found[1] if found is not None else stock.next_bound_ms()
    return as_reported(problem, replace(answer, solver=solver), min(stock_bound_ms, simulated.bound_ms),
                       exact_search=False)


def _valued(problem: PlanningProblem, layout: PlanResult, budget: Budget) -> float:
    """`handcrafted_reported_ms` of the layout, its simulations charged to `budget`."""
    budget.charge(Work.TIMELINE_OP, handcrafted_ops(problem, layout))
    return handcrafted_reported_ms(problem, layout)


def _best_scheduled(problem: PlanningProblem, candidates: list[tuple[float, PlanResult]], work: Budget,
                    total_s: float) -> PlanResult:
    """The faster of the two best candidates (by handcrafted value; ties to the earliest: the bubble-model layout,
    then the stock one) once each has its list and CP-SAT schedules: those lower layouts by different shares (2.8%
    and 0.7% for two llama2-70b layouts valued 0.1% apart), so the better-valued one can end up the slower answer.
    The runner-up is scheduled only where no schedule's bound rules it out (`reported_floor_ms`) and while the work
    budget holds its timelines."""
    order = sorted(range(len(candidates)), key=lambda i: (candidates[i][0], i))
    best: PlanResult | None = None
    for i in order[:2]:
        layout = candidates[i][1]
        if best is not None and (reported_floor_ms(problem, layout) >= best.predicted.iteration_time_s * 1e3
                                 or handcrafted_cost_s(problem, layout) > work.remaining_s()):
            break
        scheduled = with_schedules(problem, layout, work, optional_s=schedule_time_s(total_s, work.remaining_s(), problem.config))
        if best is None or scheduled.predicted.iteration_time_s < best.predicted.iteration_time_s:
            best = scheduled
    return best


def _valued_in_steps(problem: PlanningProblem, layout: PlanResult, budget: Budget) -> tuple[float, int]:
    """`_valued`, and what it cost in the checking searches' units (`checking_unit_s`): a layout of thousands of
    microbatch ops costs as many refinements as a tenth of a second of them would make."""
    units = math.ceil(handcrafted_cost_s(problem, layout) / problem.config.checking_unit_s)
    return _valued(problem, layout, budget), units


def _within_time_limit(problem: PlanningProblem, budget: Budget,
                       layout_search: Callable[[Budget], PlanResult]) -> PlanResult:
    """The layout search, then schedules, both by the budget's deadline: the search gets the budget
    less the schedule step's share (of the time left now) and the finishing reserve. The time left is
    counted in work (`Budget.as_work`), so a loaded machine gives the same plan; the solver report says
    which limit, if any, ended the search (`stopped_by`)."""
    work = budget.as_work()
    total_s = work.remaining_s()
    layout = layout_search(work.less(schedule_budget_s(total_s, problem.config) + finish_reserve_s(problem)))
    result = with_schedules(problem, layout, work, optional_s=schedule_time_s(total_s, work.remaining_s(), problem.config))
    return replace(result, solver=replace(result.solver, stopped_by=stopped_by(result.solver.status, work)))


def stopped_by(status: str, work: Budget) -> str:
    """What ended the search: `wall clock` when the wall clock overtook the work clock (the machine was
    too loaded for the answer to be the idle machine's), `work budget` when the work ran out before the
    search proved its answer, else `search finished`."""
    if work.wall_led:
        return WALL_CLOCK_STOP
    return SEARCH_FINISHED if status == "OPTIMAL" else WORK_BUDGET_STOP


def _plan_layout(problem: PlanningProblem, budget: Budget, ranked: tuple[list[Candidate], bool],
                 caches: dict | None = None, steps: list[int] | None = None) -> PlanResult:
    """Both bubble-model searches interleaved best bound first, sharing one incumbent: neither spends
    time on layouts the other has already beaten, and together they stop as soon as no bound in either
    beats the best layout found by more than `bubble_search_gap` (the answer's bound comes from the checking
    passes). Past the deadline they go on only until there is a first layout.
    The layout's solver report is in the bubble model (OPTIMAL when both searches finished). `steps`, when
    given, gets one item per refinement made: the work the checking passes are sized by."""
    steps = [] if steps is None else steps
    started = time.monotonic()
    uniform = UniformSearch(problem, budget, ranked)
    nonuniform = NonUniformSearch(problem, caches=caches, budget=budget)
    finishing = _FinishingCost(uniform, nonuniform)
    while True:
        incumbent = min(uniform.best_ms, nonuniform.best_ms)
        # The best layout's timelines must still be simulated and sent: stop in time for them.
        if incumbent < float("inf") and budget.remaining_s() <= finishing.seconds(incumbent):
            break
        next_uniform, next_nonuniform = uniform.next_bound_ms(), nonuniform.next_bound_ms()
        if min(next_uniform, next_nonuniform) >= incumbent * (1 - problem.config.bubble_search_gap):
            break
        steps.append(1)
        if next_uniform <= next_nonuniform:
            uniform.step(budget)
        else:
            nonuniform.step(budget, incumbent)
    best_uniform = uniform.result()
    found = nonuniform.result(best_uniform.objective_ms if best_uniform is not None else float("inf"))
    if found.layout is None:
        if best_uniform is None:
            raise InfeasibleError(explain_infeasible(problem))
        return _uniform_with_combined_status(problem, best_uniform, found, started)
    # The non-uniform search keeps a layout that beat the best known when it was found; the uniform search may
    # have found a better one since (in another order of the two, 31,166 against 34,459 ms on 32 H100s with three
    # slow GPUs: `tests/planner/test_pass_one_best.py`).
    if best_uniform is not None and best_uniform.objective_ms < recost(problem, found.layout).iteration_ms:
        return _uniform_with_combined_status(problem, best_uniform, found, started)
    return _assemble_nonuniform(problem, found, best_uniform, started)


class _FinishingCost:
    """What the best layout's timelines cost to simulate and send, refreshed when the best changes."""

    def __init__(self, uniform: UniformSearch, nonuniform: NonUniformSearch) -> None:
        self._uniform, self._nonuniform = uniform, nonuniform
        self._for_ms, self._seconds = None, 0.0

    def seconds(self, incumbent_ms: float) -> float:
        if incumbent_ms != self._for_ms:
            best = self._uniform if self._uniform.best_ms <= self._nonuniform.best_ms else self._nonuniform
            self._for_ms, self._seconds = incumbent_ms, ops_cost_s(best.best_timeline_ops())
        return self._seconds


def _combined_bound(uniform: SearchResult | None, found: NonUniformResult, value: float) -> tuple[float, bool]:
    """Bound over the union of both spaces; optimal when the non-uniform search finished and
    neither it nor the (possibly cut-short) uniform search leaves a bound below the answer."""
    uniform_bound = uniform.bound_ms if uniform is not None else float("inf")
    bound = min(value, uniform_bound, found.bound_ms)
    optimal = found.exhausted and bound >= value * (1 - 1e-6)
    return (value if optimal else bound), optimal


def _solver(value: float, bound: float, optimal: bool, started: float, total: int, solved: int) -> SolverResult:
    return SolverResult(
        status="OPTIMAL" if optimal else "FEASIBLE",
        wall_time_s=round(time.monotonic() - started, 3),
        gap=round(max(0.0, (value - bound) / value) if value > 0 else 0.0, 6),
        objective_ms=round(value, 3),
        bound_ms=round(bound, 3),
        candidates_total=total,
        candidates_solved=solved,
    )


def _uniform_with_combined_status(
    problem: PlanningProblem, uniform: SearchResult, found: NonUniformResult, started: float
) -> PlanResult:
    bound, optimal = _combined_bound(uniform, found, uniform.objective_ms)
    result = assemble_plan(problem, uniform)
    solver = _solver(uniform.objective_ms, bound, optimal, started,
                     uniform.candidates_total + found.outer_total, uniform.candidates_solved + found.outer_solved)
    return replace(result, solver=solver, status="optimal" if optimal else "feasible")


def _breakdown(problem: PlanningProblem, layout: NonUniformLayout) -> dict[str, float]:
    return breakdown_s(layout.terms_cache(problem), layout.replica_plan(), layout.outer.virtual_stages, layout.iteration_ms)


def nonuniform_plan(problem: PlanningProblem, found: NonUniformLayout, solver: SolverResult | None = None) -> PlanResult:
    """A non-uniform layout, recosted for its own replica count and assembled onto devices (predicted in
    the bubble model until `with_schedules`)."""
    layout = recost(problem, found)
    replicas, used = assemble_replicas(problem, layout)
    outer = layout.outer
    solver = solver or _solver(layout.iteration_ms, 0.0, False, time.monotonic(), 0, 0)
    return finish_plan(
        problem, tuple(replicas), used, layout.iteration_ms, _breakdown(problem, layout), solver,
        micro_batch_size=outer.micro_batch_size,
        schedule=ScheduleName.INTERLEAVED if outer.virtual_stages > 1 else ScheduleName.ONE_F_ONE_B,
        virtual_stages=outer.virtual_stages,
        recompute=outer.recompute,
    )


def _assemble_nonuniform(
    problem: PlanningProblem, found: NonUniformResult, uniform: SearchResult | None, started: float
) -> PlanResult:
    layout = recost(problem, found.layout)
    replicas, used = assemble_replicas(problem, layout)
    bound, optimal = _combined_bound(uniform, found, layout.iteration_ms)
    total = found.outer_total + (uniform.candidates_total if uniform else 0)
    solved = found.outer_solved + (uniform.candidates_solved if uniform else 0)
    outer = layout.outer
    return finish_plan(
        problem, tuple(replicas), used, layout.iteration_ms, _breakdown(problem, layout),
        _solver(layout.iteration_ms, bound, optimal, started, total, solved),
        micro_batch_size=outer.micro_batch_size,
        schedule=ScheduleName.INTERLEAVED if outer.virtual_stages > 1 else ScheduleName.ONE_F_ONE_B,
        virtual_stages=outer.virtual_stages,
        recompute=outer.recompute,
    )
