"""`best_split` is the exact (bottleneck, then sum) minimum over every composition under memory caps."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from planner.nonuniform.partitions import StageType
from planner.nonuniform.layer_splits import best_split
from planner.nonuniform.templates import arrange


def exhaustive(per_layer, fixed, caps, layers, unit):
    best = None
    stages = len(per_layer)
    if layers % unit:
        return None
    for cuts in itertools.combinations(range(1, layers // unit), stages - 1):
        bounds = (0, *cuts, layers // unit)
        split = [(bounds[i + 1] - bounds[i]) * unit for i in range(stages)]
        if any(n > c for n, c in zip(split, caps)):
            continue
        times = [n * a + b for n, a, b in zip(split, per_layer, fixed)]
        key = (max(times), sum(times))
        if best is None or key < best:
            best = key
    return best


@settings(max_examples=200)
@given(
    stages=st.integers(1, 5),
    layers=st.integers(1, 14),
    unit=st.sampled_from([1, 1, 2, 3]),
    data=st.data(),
)
def test_best_split_is_the_exhaustive_optimum(stages, layers, unit, data):
    per_layer = data.draw(st.lists(st.integers(1, 9).map(float), min_size=stages, max_size=stages))
    fixed = data.draw(st.lists(st.integers(0, 12).map(float), min_size=stages, max_size=stages))
    caps = data.draw(st.lists(st.integers(0, layers), min_size=stages, max_size=stages))
    expected = exhaustive(per_layer, fixed, caps, layers, unit)
    split = best_split(per_layer, fixed, caps, layers, unit)
    if expected is None:
        assert split is None
        return
    assert split is not None and sum(split) == layers and all(n % unit == 0 and n >= unit for n in split)
    assert all(n <= c for n, c in zip(split, caps))
    times = [n * a + b for n, a, b in zip(split, per_layer, fixed)]
    assert (max(times), sum(times)) == expected


def test_degraded_stages_go_to_the_middle_first():
    base, slow = StageType(4, 1.0), StageType(4, 0.5)
    assert arrange(4, base, (slow,)) == (base, slow, base, base)
    assert arrange(1, base, (slow,)) == (slow,)
    assert arrange(2, base, (slow,)) == (slow, base)


def test_terms_cache_shortcuts_equal_the_full_terms():
    """The cache prices pipeline links for `link_replicas` and memory for `memory_replicas`, and
    reads layer times without building terms: the same numbers as `stage_cost_terms` directly."""
    from dataclasses import replace

    from cost_models.layout import ParallelShape
    from cost_models.stage_costs import stage_cost_terms
    from planner.nonuniform.templates import OuterChoice, TermsCache
    from tests.planner.helpers import small_problem

    problem = small_problem(num_nodes=4, gpus_per_node=4)
    args = (problem.workload, problem.hardware)
    for v, schedule in ((1, "1f1b"), (2, "interleaved")):
        outer = OuterChoice(2, 2, 1, "none", v)
        for memory_replicas, link_replicas in ((1, 1), (1, 2), (2, 4)):
            cache = TermsCache(problem, outer, memory_replicas, link_replicas)
            for tp, stages in ((1, 1), (2, 2), (2, 3)):
                shape = ParallelShape(tp, stages, memory_replicas, 1, "none", schedule, v)
                direct = stage_cost_terms(*args, shape, problem.efficiency, problem.software)
                links = stage_cost_terms(*args, replace(shape, dp=link_replicas), problem.efficiency, problem.software)
                terms = cache.terms(tp, stages)
                expected = replace(direct, p2p_ms=links.p2p_ms)
                if v > 1:
                    expected = replace(expected, num_microbatches=2 * stages - 1)
                assert terms == expected
                assert cache.layer_time(tp) == direct.layer.time


def test_caps_outline_rules_out_only_pipelines_no_split_fits():
    """`caps_could_split` reads the first, last and roomiest middle stage instead of the whole row of
    memory caps: wherever the row admits a split (`best_split` on `max_layers_fitting_all`), it must say
    so, and it must rule out something, or it saves nothing."""
    from cost_models.stage_costs import max_layers_fitting_all
    from planner.nonuniform.templates import OuterChoice, TermsCache
    from tests.planner.helpers import small_problem

    problem = small_problem(num_nodes=4, gpus_per_node=4, global_batch=16, seq_length=2048)
    layers = problem.workload.model.num_layers
    verdicts = []
    for v in (1, 2):
        for mbs in (1, 4):
            for recompute in ("none", "full"):
                cache = TermsCache(problem, OuterChoice(2, 2, mbs, recompute, v), 1, 1)
                for tp in (1, 2, 4):
                    for stages in range(1, layers + 1):
                        for memory_gib in (0.25, 0.5, 1, 2, 4, 8, 16):
                            memory = memory_gib * 2**30
                            row = max_layers_fitting_all(cache.terms(tp, stages), memory)
                            fits = best_split([1.0] * stages, [0.0] * stages, list(row), layers, v) is not None
                            could = cache.caps_could_split(tp, stages, memory, layers, v)
                            assert could or not fits, (v, mbs, recompute, tp, stages, memory_gib, row)
                            verdicts.append((fits, could))
    assert any(fits for fits, _ in verdicts)
    assert any(not could for _, could in verdicts)
