"""The failure-aware search's optimum equals exhaustive enumeration of its space on small clusters.

The brute force enumerates, on its own: every outer choice (context-parallel
sizes included: a stage group of tp x cp GPUs); every maximal
partition of every damaged node (its own recursion); every template of the
space with the split that minimizes (bottleneck, sum) over all compositions
of the layers; every multiset of replicas the partitions' groups can supply;
and the best microbatch distribution (least T with sum_r max{m : time_r(m)
<= T} >= N). Shared with the product: the cost model (`template_costs`,
`pipeline_time_ms`) and the space's two modelling parameters (the replica
counts ZeRO memory and gradient sync are computed for).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

import pytest

from cost_models.pipeline import pipeline_time_ms
from cost_models.stage_costs import max_layers_fitting
from planner.budget import Budget
from planner.nonuniform.partitions import StageType, damaged_classes
from planner.nonuniform.outer_bounds import build_inventory
from planner.nonuniform.search import (
    _memory_replicas,
    outer_choices,
    search_nonuniform,
)
from planner.nonuniform.templates import (
    TermsCache,
    arrange,
    degraded_lengths,
    pipeline_lengths,
    template_costs,
)
from planner.uniform.candidates import tensor_parallel_sizes
from tests.planner.helpers import small_problem

INF = float("inf")


def maximal_partitions(speeds: list[float], sizes: list[int], cp: int = 1) -> list[tuple[StageType, ...]]:
    """Non-increasing TP-size sequences, contiguous blocks of tp x cp of the speed-sorted GPUs, nothing more fits."""
    ordered = sorted(speeds, reverse=True)
    out = []

    def extend(prefix: list[int], left: int) -> None:
        options = [s for s in sizes if s * cp <= left and (not prefix or s <= prefix[-1])]
        if not options:
            groups, offset = [], 0
            for size in prefix:
                groups.append(StageType(size, min(ordered[offset : offset + size * cp])))
                offset += size * cp
            out.append(tuple(groups))
            return
        for size in options:
            extend(prefix + [size], left - size * cp)

    extend([], len(ordered))
    return out


def brute_split(problem, cache, stage_types, unit):
    """(M, S)-lexicographically best composition in multiples of `unit`, under memory caps."""
    layers = problem.workload.model.num_layers
    stages = len(stage_types)
    best = None
    for cuts in itertools.combinations(range(1, layers // unit), stages - 1):
        bounds = (0, *cuts, layers // unit)
        split = tuple((bounds[i + 1] - bounds[i]) * unit for i in range(stages))
        if any(n > max_layers_fitting(cache.terms(st.tp, stages), i, problem.usable_memory_bytes)
               for i, (st, n) in enumerate(zip(stage_types, split))):
            continue
        from cost_models.iteration import stage_time

        times = [stage_time(cache.terms(st.tp, stages), i, n, st.speed).total_ms for i, (st, n) in enumerate(zip(stage_types, split))]
        key = (round(max(times), 9), round(sum(times), 9))
        if best is None or key < best[0]:
            best = (key, split)
    return None if best is None else best[1]


def best_pipeline_ms(replicas, total, v):
    """Least max over replicas of pipeline time, microbatches >= 1 each and summing to `total`."""
    if len(replicas) > total:
        return INF
    candidates = sorted({pipeline_time_ms(t.stage_ms, m, v) for t in replicas for m in range(1, total + 1)})
    for limit in candidates:
        room = 0
        for t in replicas:
            most = max((m for m in range(1, total + 1) if pipeline_time_ms(t.stage_ms, m, v) <= limit + 1e-9), default=0)
            if most == 0:
                break
            room += most
        else:
            if room >= total:
                return limit
    return INF


def brute_force_nonuniform_ms(problem) -> float:
    cluster = problem.cluster
    sizes = tensor_parallel_sizes(problem)
    best = INF
    for outer in outer_choices(problem):
        # TP sizes whose groups still cut each sequence into 2 cp chunks split over TP (Megatron's assertion).
        allowed = [s for s in sizes if s <= outer.tp and problem.workload.seq_length % (2 * outer.cp * s) == 0]
        inventory = build_inventory(problem, outer.tp, allowed, outer.cp)
        if pipeline_lengths(outer.pp)[0] > inventory.group_count_bound():
            continue
        total = problem.workload.global_batch_size // outer.micro_batch_size
        memory_replicas = _memory_replicas(problem, outer, inventory)
        sync_replicas = max(1, inventory.group_count_bound() // pipeline_lengths(outer.pp)[0])
        cache = TermsCache(problem, outer, memory_replicas, sync_replicas)
        base = StageType(outer.tp, 1.0)
        damaged = sorted(cluster.damaged_nodes)
        per_node = []
        for node in damaged:
            speeds = [cluster.speed_of(node, g) for g in range(cluster.gpus_per_node) if (node, g) not in cluster.failed]
            per_node.append(maximal_partitions(speeds, allowed, outer.cp) if speeds else [()])
        degraded_types = sorted({g for options in per_node for p in options for g in p if g != base})
        templates = []
        for stages in pipeline_lengths(outer.pp):
            forms = [arrange(stages, base, ())]
            if stages in degraded_lengths(outer.pp):
                forms += [arrange(stages, base, (d,)) for d in degraded_types]
                forms += [(d,) * stages for d in degraded_types] if stages > 1 else []
            for form in forms:
                split = brute_split(problem, cache, form, outer.virtual_stages)
                if split is not None:
                    templates.append(template_costs(problem, cache, form, split, base, sync_replicas))
        if not templates:
            continue
        healthy_groups = (cluster.num_nodes - len(damaged)) * (cluster.gpus_per_node // (outer.tp * outer.cp))
        for choice in itertools.product(*per_node):
            supply = Counter({base: healthy_groups})
            for partition in choice:
                supply.update(partition)
            # Every multiset of replicas the supply allows (at most `total` replicas).
            def multisets(index, left, chosen, templates=templates, total=total):
                if index == len(templates):
                    yield list(chosen)
                    return
                template = templates[index]
                need = Counter(template.stage_types)
                count = 0
                while True:
                    yield from multisets(index + 1, left, chosen + [template] * count, templates, total)
                    if len(chosen) + count + 1 > total or any(left[k] - need[k] * (count + 1) < 0 for k in need):
                        break
                    count += 1
                # (left is not mutated: feasibility checked against the original supply)

            for replicas in multisets(0, supply, []):
                if not replicas or len(replicas) < memory_replicas:
                    continue
                demand = Counter()
                for t in replicas:
                    demand.update(t.stage_types)
                if any(demand[k] > supply[k] for k in demand):
                    continue
                pipeline = best_pipeline_ms(replicas, total, outer.virtual_stages)
                if pipeline == INF:
                    continue
                # Replicas alike in TP per stage and layer split share a sharding: no resharding.
                kinds = {(tuple(st.tp for st in t.stage_types), t.layers_per_stage) for t in replicas}
                mixed = len(kinds) > 1
                sync = max(t.sync_resharded_ms if mixed else t.sync_uniform_ms for t in replicas)
                step = max(t.optimizer_ms for t in replicas)
                best = min(best, pipeline + sync + step)
    return best


CASES = {
    "one failed GPU, 2x4": dict(failed=("0:1",)),
    "one slow GPU, 2x4": dict(slow=(("1:2", 0.5),)),
    "failed and slow, 3x4": dict(num_nodes=3, failed=("0:0",), slow=(("2:3", 0.25),)),
    "whole node failed and a slow GPU, 3x4": dict(num_nodes=3, failed=("1:*",), slow=(("0:2", 0.5),)),
    "two failed, 4x4, batch 16": dict(num_nodes=4, failed=("0:3", "2:1"), global_batch=16),
    # Long sequences, where context parallelism wins: cp 2 on single GPUs, and tp 2 x cp 2 stages.
    "one failed GPU, 2x4, 16k tokens": dict(failed=("0:1",), global_batch=8, seq_length=16384),
    "one failed GPU, 2x4, 32k tokens": dict(failed=("0:1",), global_batch=4, seq_length=32768),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_nonuniform_search_matches_brute_force(case):
    problem = small_problem(**case)
    expected = brute_force_nonuniform_ms(problem)
    found = search_nonuniform(problem, INF, Budget.starting_now(60))
    assert found.exhausted
    assert found.layout is not None
    assert found.layout.iteration_ms == pytest.approx(expected, rel=1e-5, abs=1e-3)


def test_the_long_sequence_cases_are_won_by_context_parallelism():
    """The two long-sequence cases above check the search's context-parallel outer choices only if one of
    them is the optimum: without CP both plan slower."""
    for name in ("one failed GPU, 2x4, 16k tokens", "one failed GPU, 2x4, 32k tokens"):
        problem = small_problem(**CASES[name])
        found = search_nonuniform(problem, INF, Budget.starting_now(60))
        without = search_nonuniform(replace(problem, max_context_parallel=1), INF, Budget.starting_now(60))
        assert found.layout.outer.cp > 1
        assert found.layout.iteration_ms < without.layout.iteration_ms * 0.99


def test_partitions_match_the_independent_enumeration():
    problem = small_problem(num_nodes=3, failed=("0:0",), slow=(("2:3", 0.25),))
    for node_class in damaged_classes(problem.cluster):
        from planner.nonuniform.partitions import node_partitions

        for sizes, cp in (([1, 2, 4], 1), ([1, 2], 1), ([2, 4], 1), ([4], 1), ([1, 2], 2), ([1], 2), ([1], 3)):
            mine = sorted(p.groups for p in node_partitions(node_class.profile, tuple(sizes), cp))
            theirs = sorted(maximal_partitions(list(node_class.profile), sizes, cp))
            assert mine == theirs
