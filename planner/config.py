"""The planner's tuning: how much of the space each search covers and how it spends its time.

A `PlanningProblem` carries one (`problem.config`, default `DEFAULT_CONFIG`); functions that have no
problem at hand take a `config` argument with the same default. Every field says what it is, its unit, and
why it has this default. The domain of plans (micro-batch sizes, chunks, pipeline lengths) is part of it:
the README's "How it plans" states the space these values declare.
"""

from __future__ import annotations

from dataclasses import dataclass

# One tick of every CP-SAT time model, in ms (1 us): times are integers of ticks, so models are exact to it.
TIME_QUANTUM_MS = 1e-3


@dataclass(frozen=True)
class PlannerConfig:
    micro_batch_sizes: tuple[int, ...] | None = None
    """Micro-batch sizes tried when the request leaves `micro_batch_size` open (sequences); None: every size
    that divides the global batch (a micro-batch size that does not divide it cannot give every replica
    whole microbatches). Setting a tuple restricts the declared space, and "optimal" then means optimal
    over it; sizes that do not fit memory are dropped exactly by the memory model, not by this list."""

    max_virtual_stages: int = 8
    """Most model chunks per pipeline stage (interleaved schedules). Beyond 8 the extra pipeline sends
    outweigh the smaller bubble for every published configuration."""

    max_slow_placements: int = 256
    """Most placements of a stock layout's degraded TP groups (which replica, which stage position) the stock
    search enumerates per layer split (`planner.uniform.placements`); beyond it, packed and spread ones are
    tried and the bound assumes the best any placement could do. 256 covers two slow groups on pipelines
    up to 11 stages, or three on up to 6 stages over at least 3 replicas."""

    launch_dead_ends: int = 2000
    """Backtracks the search for a launchable device order of a stock layout may take
    (`planner.uniform.launch`) before it counts the placement as not launchable. Exact tilings of the
    small clusters the oracle checks need a few dozen; 2,000 keeps one search under ~0.1 s."""

    launch_replica_orders: int = 64
    """Most replica orders of a placement's speed rows the launch search tries one by one (every distinct
    order up to this many; beyond, slow rows first, last and evenly spaced). 64 covers two slow rows
    among up to 8 replicas."""

    prune_tolerance: float = 1e-6
    """Relative slack under which a bound counts as not beating the incumbent (1e-6 of the iteration time:
    below the 1 us tick for any iteration over a second), so float noise does not keep a search going."""

    seed_candidates: int = 64
    """Uniform shapes, best-bounded first, whose even split seeds the incumbent before the search proper:
    enough to start near the optimum, few enough to cost milliseconds."""

    shorter_pipelines: int = 2
    """Failure-aware templates with a degraded stage have pp - this .. pp stages: one or two GPUs lost
    shorten a pipeline by at most a stage or two in every scenario measured."""

    mixed_lengths: int = 6
    """Base-only templates may be as short as pp - max(shorter_pipelines, min(pp // 4, this)) stages, so
    replicas of whole healthy groups can mix lengths (Oobleck's templates)."""

    schedule_time_share: float = 0.1
    """Share of an answer's time kept for choosing pipeline schedules once the layout is known."""

    stock_units_per_step: float = 2.5
    """A failure-aware answer's stock search (`planner.plan`, pass 2: it checks more than it finds) may cost this
    many units (a split bounded or a layout simulated) per refinement the bubble-model searches made, and at
    least `min_checking_units`; counted, not timed, so the answer does not depend on the machine's load."""

    floor_steps_per_step: float = 1.25
    """Likewise the simulation-floor search (pass 3: it proves more than it finds), in its own refinements; a layout it
    values by simulation counts as the refinements that simulation takes at `checking_unit_s` each."""

    min_checking_units: int = 1500
    """Least units each checking search gets: small clusters finish within it."""

    checking_unit_s: float = 5e-4
    """About the most one unit of the checking searches takes (0.2-0.4 ms measured from 256 to 4,096 GPUs): where
    the time left is below their units at this rate, they get fewer units (`planner.plan`)."""

    bubble_search_share: float = 0.5
    """Most of a failure-aware answer's layout time the bubble-model searches may take (`planner.plan`); the
    stock search and the simulation-floor search get what they leave. Small clusters need a fraction of it."""

    bubble_search_gap: float = 0.02
    """Pass 1 (the bubble-model searches, `planner.plan`) stops once no bound left beats its best layout by more than this
    share. Its layout is a candidate, not the proof: the bound a plan reports comes from the stock and
    simulation-floor searches, which go on to their own end. Bubble-model bounds sit 10-25% below reported times at
    256 GPUs, so the last 2% of pass 1 is mostly spent proving, not finding."""

    max_optimize_s_per_replica: float = 1.0
    """Most seconds the CP-SAT schedule gets for one replica: past a second it rarely gains 0.1%."""

    min_optimize_s: float = 0.25
    """Least seconds worth starting a CP-SAT schedule with; below it the model is barely built."""

    min_iteration_gain: float = 5e-3
    """CP-SAT schedules are sought only while the plan's pipeline is more than this share of the iteration
    above what the replicas' bounds allow."""

    max_optimized_ops: int = 6_000
    """Most ops (stages x chunks x microbatches x 3) of a replica whose schedule CP-SAT is asked to improve
    when a handcrafted one runs: bigger models take longer to build than the time they get."""

    max_improved_ops: int = 4_000
    """Most ops (as above) of a replica CP-SAT is asked to improve once its list schedules ran (`with_schedules`).
    CP-SAT's load and presolve, which its deterministic time does not count, grow faster than the ops (3,072 ops
    0.24 s, 5,418 ops 1.0 s, 6,144 ops 1.1 s measured): past this the wall-clock safety net, not the counted
    work, stopped it (qwen2.5-72b on 256 A100s, 8 GPUs lost: 1.0 s spent for 0.01 of its 0.25 units, no gain)."""

    min_gain_fraction: float = 1e-3
    """A schedule must beat the best handcrafted one by this share of its makespan to replace it."""

    optimality_gap: float = 2e-3
    """CP-SAT schedules stop this close (relative) to the bound: a plan need not pay seconds for the last
    0.2%."""

    min_required_optimize_s: float = 1.0
    """Seconds the CP-SAT schedule gets at least when it is the only schedule allowed (`optimized` alone)."""

    placement_time_share: float = 0.1
    """Share of a replan's time kept for placing the new layout on the devices that hold its state."""

    max_exact_nodes: int = 128
    """Largest class of alike nodes whose roles are matched node to node (a min-cost assignment, cubic in
    the class size); larger classes keep roles on their nodes and match GPUs only."""

    shapes_per_clock_check: int = 512
    """Uniform shapes costed, and charged to the work clock, between looks at it."""


DEFAULT_CONFIG = PlannerConfig()
