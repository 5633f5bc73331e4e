"""Pick the fastest schedule for one replica that fits its memory.

Candidates are the handcrafted schedules that apply to the replica's
chunking, then a CP-SAT schedule seeded with the best of them when it can
still gain (the best handcrafted one is above the lower bound). The
simulator is the judge for every candidate, so the winner's timeline is
exactly what the plan reports.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from cost_models.choices import ScheduleName
from planner.config import DEFAULT_CONFIG, PlannerConfig
from planner.errors import PlanningError
from planner.schedules.bounds import lower_bound_ms
from planner.schedules.handcrafted import handcrafted_schedules
from planner.schedules.ops import PipelineSpec, Schedule
from planner.schedules.optimal import OPTIMIZED, optimize_schedule
from planner.schedules.simulator import SimulationResult, simulate


@dataclass(frozen=True)
class ChosenSchedule:
    schedule: Schedule
    simulation: SimulationResult
    candidates_ms: tuple[tuple[str, float], ...]
    solver_deterministic_time: float = 0.0  # CP-SAT's, when it ran: the work a budget is charged for it


TIE_PREFERENCE = (ScheduleName.ONE_F_ONE_B, ScheduleName.INTERLEAVED, ScheduleName.ZB_H1, ScheduleName.ZB_H2, ScheduleName.GPIPE,
                  ScheduleName.LOOPED_BFS, OPTIMIZED)


def preference(name: str) -> int:
    """Rank among equally fast schedules: the most widely run first."""
    return TIE_PREFERENCE.index(name) if name in TIE_PREFERENCE else len(TIE_PREFERENCE)


def _fits(simulation: SimulationResult, spec: PipelineSpec) -> bool:
    return not simulation.over_memory(spec)


def cp_sat_ops(spec: PipelineSpec) -> int:
    """Ops of `spec`'s CP-SAT schedule model, every backward split: what its size caps count."""
    return spec.num_stages * spec.virtual_stages * spec.num_microbatches * 3


def choose_schedule(
    spec: PipelineSpec,
    *,
    allowed: Collection[str] | None = None,
    optimize_time_limit_s: float = 0.0,
    min_gain_ms: float = 0.0,
    seed: int = 0,
    simulated: Sequence[tuple[Schedule, SimulationResult]] | None = None,
    use_solver: bool = True,
    start: Schedule | None = None,
    config: PlannerConfig = DEFAULT_CONFIG,
) -> ChosenSchedule:
    """The fastest allowed schedule whose activations fit; ties go to the one holding less memory.

    `allowed` None means every schedule. CP-SAT runs only when the best
    handcrafted order is more than `min_gain_ms` above the lower bound. If
    no allowed schedule fits the activation limit, the one with the smallest
    overshoot is returned: the layout search already sized memory for 1F1B,
    so this happens only for a restricted choice such as GPipe. `simulated`,
    the handcrafted schedules of `spec` already simulated (`handcrafted_runs`),
    saves simulating them again. Without `use_solver` only the greedy list
    schedules are tried (`optimize_schedule`), not CP-SAT. `start`, an order
    already known to beat the handcrafted ones (an earlier list schedule),
    seeds CP-SAT instead of the list schedules.
    """
    handcrafted = list(simulated) if simulated is not None else handcrafted_runs(spec)
    tried = [item for item in handcrafted if allowed is None or item[0].name in allowed]
    optimize_allowed = allowed is None or OPTIMIZED in allowed
    if not tried and not optimize_allowed:
        raise PlanningError(
            f"none of the schedules {sorted(allowed or ())} runs {spec.virtual_stages} model chunks per stage"
        )
    # Without an allowed handcrafted schedule the best one still seeds CP-SAT.
    best = best_run(tried or handcrafted, spec)
    best_allowed = bool(tried)
    ops = cp_sat_ops(spec)
    worth_optimizing = (
        optimize_allowed
        and (optimize_time_limit_s > 0 or not tried)
        and spec.num_stages > 1
        and (ops <= config.max_optimized_ops or not tried)
        and _fits(best[1], spec)
        and (best[1].makespan_ms - lower_bound_ms(spec) > max(min_gain_ms, config.min_gain_fraction * best[1].makespan_ms)
             or not tried)
    )
    if worth_optimizing:
        optimized = optimize_schedule(
            spec, time_limit_s=optimize_time_limit_s if tried else max(optimize_time_limit_s, config.min_required_optimize_s),
            split_backward=True,
            hint=start or best[0], seed=seed, relative_gap_limit=config.optimality_gap, use_solver=use_solver,
            warm_start=start is None,
        )
        if optimized is not None:
            simulation = simulate(optimized.schedule, spec)
            tried.append((optimized.schedule, simulation))
            gains = simulation.reported_ms < best[1].reported_ms * (1 - config.min_gain_fraction)
            if _fits(simulation, spec) and (gains or not best_allowed):
                best, best_allowed = (optimized.schedule, simulation), True
    if not best_allowed:
        raise PlanningError(
            "the only allowed schedule is `optimized` and CP-SAT found none in time; allow a handcrafted one "
            f"({', '.join(schedule.name for schedule, _ in handcrafted)}) or raise options.time_limit_s"
        )
    return ChosenSchedule(
        schedule=best[0],
        simulation=best[1],
        candidates_ms=tuple((schedule.name, simulation.makespan_ms) for schedule, simulation in tried),
        solver_deterministic_time=optimized.deterministic_time if worth_optimizing and optimized is not None else 0.0,
    )


def handcrafted_runs(spec: PipelineSpec) -> list[tuple[Schedule, SimulationResult]]:
    """Every handcrafted schedule that applies to `spec`, with its simulation."""
    return [(schedule, simulate(schedule, spec)) for schedule in handcrafted_schedules(spec)]


def best_run(tried: list[tuple[Schedule, SimulationResult]], spec: PipelineSpec) -> tuple[Schedule, SimulationResult]:
    """The fastest run that fits memory (ties: fewer activations, then the most widely run schedule); when
    none fits, the one overshooting least. What a plan's replica gets among `tried`."""
    fitting = [item for item in tried if _fits(item[1], spec)]
    if fitting:
        # Equal makespans: the one holding fewer activations, then the most widely run.
        return min(fitting, key=lambda item: (
            round(item[1].reported_ms, 6), round(max(item[1].peak_activation_gib), 6), preference(item[0].name),
        ))
    limits = spec.activation_limit_gib or ()
    return min(
        tried,
        key=lambda item: max((peak - cap for peak, cap in zip(item[1].peak_activation_gib, limits)), default=0.0),
    )


