"""Which state each device of a layout holds."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from planner.replan.holdings import (
    PlacedLayout,
    PlacedStage,
    chunk_layer_runs,
    device_holdings,
)


def test_interleaved_chunks_follow_the_looped_order():
    # 2 stages of 3 layers, 2 chunks: virtual stages 0..3 hold 2, 2, 1, 1 layers.
    assert chunk_layer_runs([3, 3], 2) == [[(0, 2), (4, 5)], [(2, 4), (5, 6)]]
    assert chunk_layer_runs([2, 5], 1) == [[(0, 2)], [(2, 7)]]


def test_uneven_chunks_hold_the_layers_the_plan_gives_them():
    # An estimate's layers_per_chunk [1, 3, 3, 1]: stage 0 holds layer 0 and layers 4-6, stage 1 layers 1-3 and 7.
    assert chunk_layer_runs([4, 4], 2, [(1, 3), (3, 1)]) == [[(0, 1), (4, 7)], [(1, 4), (7, 8)]]


def test_a_plans_uneven_chunks_reach_the_migration_model():
    from executor.layout import build_layout
    from planner.replan.holdings import placed_layout
    from tests.executor.support import REQUESTS

    from api.tasks.planning import estimate_for
    from wire.schemas import EstimateRequest

    plan = estimate_for(EstimateRequest.model_validate(REQUESTS["uneven-chunks"]))
    placed = placed_layout(plan)
    assert [stage.chunk_layers for stage in placed.replicas[0]] == [(1, 3), (3, 1)]
    held = device_holdings(placed)
    # The layers (units 1..L) each device holds are those the reference executor builds there.
    built = build_layout(plan).replicas[0]
    num_layers = plan.architecture.num_layers
    for stage in built.stages:
        layers = sorted(i for part in built.parts if part.stage == stage.stage for i in part.layers)
        device = plan.replicas[0].stages[stage.stage].devices[0]
        units = {unit for block in held[device] for unit in range(block.first_unit, block.end_unit)}
        assert sorted(unit - 1 for unit in units if 1 <= unit <= num_layers) == layers


def test_chunks_match_the_reference_executor():
    from executor.layout import chunk_sizes

    counts = [5, 3, 4]
    runs = chunk_layer_runs(counts, 3)
    for stage, count in enumerate(counts):
        assert [end - first for first, end in runs[stage]] == [n for n in chunk_sizes(count, 3) if n]


@st.composite
def layouts(draw):
    num_layers = draw(st.integers(2, 12))
    v = draw(st.integers(1, 3))
    zero = draw(st.sampled_from([0, 1, 2, 3]))
    cp = draw(st.sampled_from([1, 2, 3]))  # context-parallel ranks, the same on every stage (they sync together)
    replicas = []
    next_gpu = 0
    for _ in range(draw(st.integers(1, 4))):
        stages_count = draw(st.integers(1, min(4, num_layers)))
        cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=stages_count - 1, max_size=stages_count - 1)))
        bounds = [0, *cuts, num_layers]
        stages = []
        for first, end in zip(bounds, bounds[1:]):
            tp = draw(st.sampled_from([1, 2, 4]))
            stages.append(PlacedStage(tuple(f"0:{next_gpu + k}" for k in range(tp * cp)), (first, end), cp))
            next_gpu += tp * cp
        replicas.append(tuple(stages))
    return PlacedLayout(tuple(replicas), v, zero, num_layers)


@given(layouts())
def test_every_unit_is_held_once_per_replica_and_its_optimizer_state_as_zero_says(layout):
    # Exact cover on a grid of atoms: weights once per replica and CP rank (once in all with ZeRO-3), optimizer
    # state once in all (ZeRO-1 to 3, mixed TP sizes included) or once per replica and CP rank (no ZeRO);
    # measuring widths alone misses overlaps.
    holdings = device_holdings(layout)
    cp = layout.replicas[0][0].cp
    sizes = [len(stage.devices) // stage.cp for replica in layout.replicas for stage in replica]
    grid = math.lcm(*sizes) * len(layout.replicas) * cp
    weight, optimizer = Counter(), Counter()
    for blocks in holdings.values():
        for b in blocks:
            for unit in range(b.first_unit, b.end_unit):
                weight.update((unit, a) for a in range(round(b.weight_lo * grid), round(b.weight_hi * grid)))
                optimizer.update((unit, a) for a in range(round(b.optimizer_lo * grid), round(b.optimizer_hi * grid)))
    every = {(unit, a) for unit in range(layout.num_layers + 2) for a in range(grid)}
    copies = len(layout.replicas) * cp
    assert set(weight) == every and set(weight.values()) == {1 if layout.zero_stage == 3 else copies}
    assert set(optimizer) == every and set(optimizer.values()) == {1 if layout.zero_stage else copies}
