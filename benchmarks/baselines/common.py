"""What the baselines share: their result, the healthy layout they start from, microbatch
allocation and the iteration time of a set of replicas under resiplan's cost model.

Every baseline is evaluated with resiplan's own numbers: stage times from
`cost_models.iteration.stage_time` (through `planner.nonuniform.templates` Templates),
the pipeline formula `cost_models.pipeline.pipeline_time_ms`, exposed
gradient sync (hierarchical when every replica is sharded alike, resharded
once they differ) and the optimizer step, combined as
`cost_models.resharding.nonuniform_iteration_ms` does.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cost_models.pipeline import pipeline_time_ms
from cost_models.resharding import nonuniform_iteration_ms
from cost_models.stage_costs import max_layers_fitting
from planner.nonuniform.templates import OuterChoice, Template, TermsCache
from planner.plan import plan_uniform
from planner.problem import PlanningProblem
from planner.result import PlanResult

Device = tuple[int, int]


@dataclass(frozen=True)
class BaselineResult:
    """A baseline's layout, evaluated with resiplan's cost model.

    iteration_ms: predicted iteration time; tokens_per_s: global batch x sequence length per second;
    gpus_used: GPUs holding a part of the model (idle ones not counted); description: the layout, for people.
    """

    name: str
    iteration_ms: float
    tokens_per_s: float
    gpus_used: int
    description: str


def make_result(problem: PlanningProblem, name: str, iteration_ms: float, gpus_used: int, description: str) -> BaselineResult:
    workload = problem.workload
    tokens = workload.global_batch_size * workload.seq_length / (iteration_ms / 1e3)
    return BaselineResult(name, iteration_ms, tokens, gpus_used, description)


def without_failures(problem: PlanningProblem) -> PlanningProblem:
    """The same cluster, every GPU healthy."""
    return replace(problem, cluster=replace(problem.cluster, failed=frozenset(), slow=()))


@dataclass(frozen=True)
class HealthyLayout:
    """resiplan's uniform layout for the healthy cluster, as the baselines that adapt it read it.

    groups[replica][stage]: the TP group's devices.
    """

    outer: OuterChoice
    dp: int
    layers_per_stage: tuple[int, ...]
    microbatches_per_replica: int
    groups: tuple[tuple[tuple[Device, ...], ...], ...]
    iteration_ms: float

    @property
    def tp(self) -> int:
        return self.outer.tp

    @property
    def pp(self) -> int:
        return self.outer.pp


def healthy_plan(problem: PlanningProblem) -> PlanResult:
    """The layout resiplan picks for the cluster without failures (uniform search)."""
    return plan_uniform(without_failures(problem))


def read_layout(result: PlanResult) -> HealthyLayout:
    first = result.replicas[0]
    stages = first.stages
    outer = OuterChoice(
        tp=stages[0].tp,
        pp=len(stages),
        micro_batch_size=result.micro_batch_size,
        recompute=result.recompute,
        virtual_stages=result.virtual_stages,
    )
    groups = tuple(
        tuple(tuple(_parse(d) for d in stage.devices) for stage in replica.stages) for replica in result.replicas
    )
    return HealthyLayout(
        outer=outer,
        dp=len(result.replicas),
        layers_per_stage=tuple(b - a for a, b in (s.layers for s in stages)),
        microbatches_per_replica=first.num_microbatches,
        groups=groups,
        iteration_ms=result.solver.objective_ms,
    )


def _parse(text: str) -> Device:
    node, _, gpu = text.partition(":")
    return int(node), int(gpu)


def allocate_microbatches(stage_ms: Sequence[Sequence[float]], total: int, virtual_stages: int) -> list[int]:
    """Microbatches per replica minimizing the slowest replica's pipeline time.

    Greedy: each next microbatch goes to the replica whose pipeline would finish
    earliest with it. Pipeline time grows with the microbatch count, so this
    picks the `total` smallest finishing times overall, which is optimal for
    the min-max (a replica may get none).
    """
    counts = [0] * len(stage_ms)
    heap = [(pipeline_time_ms(times, 1, virtual_stages), r) for r, times in enumerate(stage_ms)]
    heapq.heapify(heap)
    for _ in range(total):
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (pipeline_time_ms(stage_ms[r], counts[r] + 1, virtual_stages), r))
    return counts


def sharding_key(template: Template) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What decides whether replicas' gradients line up: TP size per stage and stage boundaries
    (`cost_models.resharding`); replicas differing only in speed are sharded alike."""
    return tuple(st.tp for st in template.stage_types), template.layers_per_stage


def iteration_ms(templates: Sequence[Template], microbatches: Sequence[int], virtual_stages: int) -> float:
    """Iteration of replicas (one template each) running these microbatch counts.

    Every replica takes part in the gradient sync and the ZeRO-1 optimizer step,
    also one that runs no microbatch. The sync is resharded once two replicas
    are sharded differently (TP sizes or stage boundaries), hierarchical otherwise.
    """
    mixed = len({sharding_key(t) for t in templates}) > 1
    replicas = [(t.stage_ms, m) for t, m in zip(templates, microbatches)]
    syncs = [t.sync_resharded_ms if mixed else t.sync_uniform_ms for t in templates]
    optimizers = [t.optimizer_ms for t in templates]
    return nonuniform_iteration_ms(replicas, virtual_stages, syncs, optimizers)


def fits_memory(problem: PlanningProblem, cache: TermsCache, template: Template) -> bool:
    """Whether every stage's layers fit its GPUs' memory (the ZeRO-1 replicas `cache` was built for)."""
    stages = len(template.stage_types)
    capacity = problem.hardware.gpu.memory_bytes
    return all(
        n <= max_layers_fitting(cache.terms(st.tp, stages), i, capacity)
        for i, (st, n) in enumerate(zip(template.stage_types, template.layers_per_stage))
    )
