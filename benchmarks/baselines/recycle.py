"""ReCycle-style rerouting: keep resiplan's healthy-cluster layout, reroute around failed stages.

Modelling choices (resiplan's cost model throughout):

- The layout is the uniform one resiplan picks for the cluster without
  failures, unchanged: same TP groups, split, micro-batch size, schedule and
  microbatches per replica (every replica keeps its own microbatches).
- A TP group holding a failed GPU is lost. If f_i replicas lose stage i,
  their f_i m stage-i microbatches are rerouted, whole, to the dp - f_i
  surviving stage-i groups (their data-parallel peers), each to the peer
  whose stage would finish its load earliest (evenly among equal peers).
  A peer running m + e microbatches has its per-microbatch stage time scaled
  by (m + e) / m. With equal peers and f_i m / (dp - f_i) whole this is
  dp / (dp - f_i), i.e. the continuous model 1 + 1 / (dp - 1) for one failed
  replica; whole microbatches matter when replicas run few of them (m = 2 on
  128 replicas: two peers run 3 microbatches, a 1.5x stage, not 128/127),
  and f_i in the numerator counts all rerouted work when several replicas
  lose the same stage.
- A replica that lost stage i waits at that position for the peers running
  its microbatches: its stage i takes the slowest of their scaled times.
- Slow GPUs are not adapted to: a group runs at its slowest member's speed.
- If every replica lost the same stage, nothing is left to reroute to: infeasible.
- Not modelled, in ReCycle's favour: ReCycle schedules rerouted work into
  pipeline bubbles (here it lengthens the peers' stage time instead), and the
  extra activations the peers hold for the rerouted microbatches are not
  checked against memory.
- Gradient sync is the healthy layout's (same sharding, all dp replicas), a
  slight overestimate for stages with fewer surviving peers; optimizer step
  as in the healthy layout (ZeRO-1 over dp replicas).

With no failed or slow GPU this is exactly the healthy plan's iteration time.
"""

from __future__ import annotations

import heapq

from benchmarks.baselines.common import (
    BaselineResult,
    healthy_plan,
    make_result,
    read_layout,
)
from cost_models.iteration import stage_time
from cost_models.pipeline import pipeline_time_ms
from planner.errors import InfeasibleError
from planner.nonuniform.partitions import StageType
from planner.nonuniform.templates import TermsCache, template_costs
from planner.problem import PlanningProblem
from planner.result import PlanResult

NAME = "recycle"


def _reroute(times: list[list[float | None]], stage: int, rerouted: int, microbatches: int) -> None:
    """Give `rerouted` stage microbatches to the surviving peers, each to the one finishing earliest;
    scale their stage times and set the lost groups' times to the slowest receiving peer's."""
    extra = {r: 0 for r, row in enumerate(times) if row[stage] is not None}
    heap = [((microbatches + 1) * times[r][stage], r) for r in extra]
    heapq.heapify(heap)
    for _ in range(rerouted):
        _, r = heapq.heappop(heap)
        extra[r] += 1
        heapq.heappush(heap, ((microbatches + extra[r] + 1) * times[r][stage], r))
    for r, e in extra.items():
        times[r][stage] *= (microbatches + e) / microbatches
    slowest = max(times[r][stage] for r, e in extra.items() if e > 0)
    for row in times:
        if row[stage] is None:
            row[stage] = slowest


def run(problem: PlanningProblem, healthy: PlanResult | None = None) -> BaselineResult:
    """`healthy`: resiplan's plan for the cluster without failures (computed when not given)."""
    layout = read_layout(healthy if healthy is not None else healthy_plan(problem))
    cluster = problem.cluster
    dp, pp, split = layout.dp, layout.pp, layout.layers_per_stage
    cache = TermsCache(problem, layout.outer, dp)
    terms = cache.terms(layout.tp, pp)

    # Per replica and stage: None if the group lost a GPU, else its speed.
    speeds = [
        [None if any(d in cluster.failed for d in devices) else min(cluster.speed_of(*d) for d in devices)
         for devices in groups]
        for groups in layout.groups
    ]
    lost = [sum(1 for row in speeds if row[i] is None) for i in range(pp)]
    if any(f == dp for f in lost):
        raise InfeasibleError("recycle: every replica lost the same stage; no peer to reroute to")

    # Surviving groups run their own microbatches and the rerouted ones given to them.
    m = layout.microbatches_per_replica
    times: list[list[float | None]] = [
        [None if s is None else stage_time(terms, i, split[i], s).total_ms for i, s in enumerate(row)] for row in speeds
    ]
    for i in range(pp):
        if lost[i]:
            _reroute(times, i, lost[i] * m, m)

    v = layout.outer.virtual_stages
    pipeline = max(pipeline_time_ms(row, m, v) for row in times)
    base = StageType(layout.tp, 1.0)
    template = template_costs(problem, cache, (base,) * pp, split, base, dp)
    value = pipeline + template.sync_uniform_ms + template.optimizer_ms

    gpus = sum(len(devices) for groups, row in zip(layout.groups, speeds) for devices, s in zip(groups, row) if s is not None)
    description = (
        f"tp={layout.tp} pp={pp} dp={dp} mbs={layout.outer.micro_batch_size} v={v} {layout.outer.recompute}; "
        f"{sum(lost)} stages rerouted, {sum(1 for row in speeds for s in row if s is not None and s < 1)} slow stages"
    )
    return make_result(problem, NAME, value, gpus, description)
