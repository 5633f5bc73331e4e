"""Oobleck-style pipeline templates of whole nodes.

- Nodes with a failed GPU are excluded entirely; a node with slow GPUs stays
  and runs at its slowest GPU's speed (every stage on it).
- TP is the node: tp = gpus_per_node when the model's heads allow it, else
  the largest allowed size dividing the node, with several stages per node.
- A template is k consecutive whole nodes (k = 1..K), each node one stage (or
  gpus_per_node / tp stages); its layers split speed-aware with
  `planner.nonuniform.templates.build_template` (`best_split`: least bottleneck, then
  least sum, under memory caps), 1F1B (Oobleck has no interleaving).
- The available nodes are covered with a multiset of templates of at most two
  distinct sizes (x copies of size a, y of size b, as many as fit); nodes
  left over are the slowest ones. Slow nodes go into the pipelines either
  packed (few pipelines hold them) or spread (one per pipeline), whichever is
  faster, in middle positions.
- Microbatches go to pipelines greedily as in ResiHP
  (`common.allocate_microbatches`); iteration = slowest pipeline + exposed
  gradient sync (resharded once pipelines differ) + optimizer step.

Micro-batch size and recompute are searched too (in Oobleck the user fixes
them; searching them only helps the baseline). The search is bounded: covers
are examined in order of a lower bound valid for every placement (each
pipeline of size k runs m microbatches in at least (m - 1) M_k + S_k, M_k
and S_k the healthy template's bottleneck and sum with the most memory any
replica count gives), until the bound cannot beat the best cover found or
`MAX_EVALUATIONS` covers have been evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.baselines.common import (
    BaselineResult,
    allocate_microbatches,
    iteration_ms,
    make_result,
)
from planner.errors import InfeasibleError
from planner.nonuniform.partitions import StageType
from planner.nonuniform.templates import (
    OuterChoice,
    Template,
    TermsCache,
    build_template,
    degraded_positions,
)
from planner.problem import PlanningProblem
from planner.result import PlanResult
from planner.uniform.candidates import tensor_parallel_sizes

NAME = "oobleck"
MAX_EVALUATIONS = 10000
PRUNE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class _SizeStats:
    """Lower bounds for any pipeline of one size: bottleneck, stage-time sum, optimizer step."""

    bottleneck_ms: float
    total_ms: float
    optimizer_ms: float


@dataclass(frozen=True)
class _Cover:
    outer: OuterChoice
    counts: tuple[tuple[int, int], ...]  # (template nodes, copies), larger templates first


def node_tensor_parallel(problem: PlanningProblem) -> int:
    per_node = problem.cluster.gpus_per_node
    return max(tp for tp in tensor_parallel_sizes(problem) if per_node % tp == 0)


def _pipeline_lower_bound(stats: list[tuple[_SizeStats, int]], microbatches: int) -> float:
    """Least T with sum_k copies_k * max(0, (T - S_k) / M_k + 1) >= microbatches (relaxed)."""
    lines = sorted((s.total_ms - s.bottleneck_ms, copies / s.bottleneck_ms) for s, copies in stats)
    slope = offset = 0.0
    for index, (start, rate) in enumerate(lines):
        slope += rate
        offset += rate * start
        value = (microbatches + offset) / slope
        if index + 1 == len(lines) or value <= lines[index + 1][0]:
            return value
    return float("inf")


class _Search:
    def __init__(self, problem: PlanningProblem) -> None:
        self.problem = problem
        cluster = problem.cluster
        failed_nodes = {node for node, _ in cluster.failed}
        self.nodes = [n for n in range(cluster.num_nodes) if n not in failed_nodes]
        self.speed = {n: min(cluster.speed_of(n, g) for g in range(cluster.gpus_per_node)) for n in self.nodes}
        self.tp = node_tensor_parallel(problem)
        self.stages_per_node = cluster.gpus_per_node // self.tp
        self.base = StageType(self.tp, 1.0)
        self._caches: dict[tuple[OuterChoice, int], TermsCache] = {}
        self._templates: dict[tuple[OuterChoice, int, tuple[StageType, ...]], Template | None] = {}

    def cache(self, outer: OuterChoice, replicas: int) -> TermsCache:
        key = (outer, replicas)
        if key not in self._caches:
            self._caches[key] = TermsCache(self.problem, outer, replicas)
        return self._caches[key]

    def template(self, outer: OuterChoice, replicas: int, node_speeds: tuple[float, ...]) -> Template | None:
        stage_types = tuple(StageType(self.tp, s) for s in node_speeds for _ in range(self.stages_per_node))
        key = (outer, replicas, stage_types)
        if key not in self._templates:
            self._templates[key] = build_template(
                self.problem, outer, self.cache(outer, replicas), stage_types, self.base, replicas
            )
        return self._templates[key]

    def outers(self) -> list[OuterChoice]:
        batch = self.problem.workload.global_batch_size
        return [
            OuterChoice(self.tp, 1, mbs, recompute, 1)
            for mbs in self.problem.micro_batch_sizes if batch % mbs == 0
            for recompute in self.problem.recompute_modes
        ]

    def covers(self) -> list[tuple[float, int, _Cover]]:
        """Every cover with its lower bound."""
        out: list[tuple[float, int, _Cover]] = []
        available = len(self.nodes)
        largest = min(available, self.problem.workload.model.num_layers // self.stages_per_node)
        for outer in self.outers():
            microbatches = self.problem.workload.global_batch_size // outer.micro_batch_size
            most_replicas = min(microbatches, available)
            stats: dict[int, _SizeStats] = {}
            for k in range(1, largest + 1):
                t = self.template(outer, most_replicas, (1.0,) * k)
                if t is not None:
                    # Some stage holds at least the mean parameters, whatever the split.
                    mean_share = sum(t.params_per_gpu) / len(t.params_per_gpu) / max(t.params_per_gpu)
                    stats[k] = _SizeStats(t.bottleneck_ms, t.total_ms, t.optimizer_ms * mean_share)
            sizes = sorted(stats)
            for i, a in enumerate(sizes):
                shapes = [((a, available // a),)]
                for b in sizes[i + 1:]:
                    for y in range(1, available // b + 1):
                        x = (available - y * b) // a
                        if x > 0:
                            shapes.append(((b, y), (a, x)))
                for counts in shapes:
                    if sum(c for _, c in counts) > microbatches:
                        continue
                    pipeline = _pipeline_lower_bound([(stats[k], c) for k, c in counts], microbatches)
                    bound = pipeline + min(stats[k].optimizer_ms for k, _ in counts)
                    out.append((bound, len(out), _Cover(outer, counts)))
        return out

    def placements(self, cover: _Cover) -> list[list[tuple[float, ...]]]:
        """Node speeds per pipeline: slow nodes packed, and spread (one per pipeline)."""
        sizes = [k for k, copies in cover.counts for _ in range(copies)]
        used = sum(sizes)
        by_speed = sorted(self.nodes, key=lambda n: (self.speed[n], n))
        idle = len(self.nodes) - used
        slow = [self.speed[n] for n in by_speed[idle:] if self.speed[n] < 1.0]
        if not slow:
            return [[(1.0,) * k for k in sizes]]
        packed: list[list[float]] = [[] for _ in sizes]
        queue = list(slow)
        for r, k in enumerate(sizes):
            while queue and len(packed[r]) < k:
                packed[r].append(queue.pop(0))
        spread: list[list[float]] = [[] for _ in sizes]
        queue = list(slow)
        while queue:
            for r, k in enumerate(sizes):
                if queue and len(spread[r]) < k:
                    spread[r].append(queue.pop(0))
        return [[self._arrange(k, speeds) for k, speeds in zip(sizes, assignment)] for assignment in (packed, spread)]

    @staticmethod
    def _arrange(k: int, slow: list[float]) -> tuple[float, ...]:
        speeds = [1.0] * k
        for position, s in zip(degraded_positions(k), sorted(slow, reverse=True)):
            speeds[position] = s
        return tuple(speeds)

    def evaluate(self, cover: _Cover) -> tuple[float, list[Template], list[int]] | None:
        outer = cover.outer
        replicas = sum(c for _, c in cover.counts)
        microbatches = self.problem.workload.global_batch_size // outer.micro_batch_size
        best = None
        for placement in self.placements(cover):
            templates = [self.template(outer, replicas, speeds) for speeds in placement]
            if any(t is None for t in templates):
                continue
            counts = allocate_microbatches([t.stage_ms for t in templates], microbatches, 1)
            value = iteration_ms(templates, counts, 1)
            if best is None or value < best[0]:
                best = (value, templates, counts)
        return best


def run(problem: PlanningProblem, healthy: PlanResult | None = None) -> BaselineResult:
    """`healthy` is not needed here; accepted for a common signature."""
    search = _Search(problem)
    if not search.nodes:
        raise InfeasibleError("oobleck: every node has a failed GPU")
    best: tuple[float, _Cover, list[Template], list[int]] | None = None
    evaluated = 0
    unexamined_bound = None  # set when the evaluation cap, not the bound, ends the search
    for bound, _, cover in sorted(search.covers(), key=lambda item: item[:2]):
        if best is not None and bound >= best[0] * (1 - PRUNE_TOLERANCE):
            break
        if evaluated >= MAX_EVALUATIONS:
            unexamined_bound = bound
            break
        evaluated += 1
        found = search.evaluate(cover)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], cover, found[1], found[2])
    if best is None:
        raise InfeasibleError("oobleck: no node template fits the model in memory")
    value, cover, templates, counts = best
    outer = cover.outer
    gpus = sum(len(t.stage_types) * search.tp for t in templates)
    shape = " + ".join(f"{c}x{k} nodes" for k, c in cover.counts)
    description = (
        f"templates {shape} ({len(search.nodes)} nodes available), tp={search.tp}, "
        f"mbs={outer.micro_batch_size} {outer.recompute}; microbatches {min(counts)}..{max(counts)}; "
        f"{evaluated} covers evaluated"
    )
    if unexamined_bound is not None:
        description += f" (cap reached; unexamined covers >= {unexamined_bound / value:.1%} of this)"
    return make_result(problem, NAME, value, gpus, description)
