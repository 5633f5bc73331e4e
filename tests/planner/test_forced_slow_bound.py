"""Shapes that cannot avoid slow GPUs are bounded as such (`planner.uniform.candidates.forced_slow`).

A uniform layout takes dp x pp slots; where the full-speed ones are fewer, it runs degraded ones, and by
pigeonhole one replica holds ceil(forced / dp) of them. The search's bounds then count that replica's slower
stages, which prunes shapes a 0.25x GPU makes hopeless before their splits are solved. That the bounds stay
below every layout is the placed oracle's check (`tests/oracle/test_placed_oracle.py`, which fails when this
bound is made stronger than its argument allows: BENCHMARKS.md, "Oracle mutation runs").
"""

from __future__ import annotations

from cost_models.layout import ParallelShape
from planner.devices import build_cluster_state, slot_inventory
from planner.uniform.candidates import ForcedSlow, forced_slow, ranked_candidates
from tests.planner.helpers import small_problem


def _shape(dp: int, pp: int) -> ParallelShape:
    return ParallelShape(tp=4, pp=pp, dp=dp, micro_batch_size=1, recompute="none")


def test_forced_slow_stages_follow_from_the_slots_a_shape_must_take():
    # 4 nodes x 8 GPUs in TP groups of 4: nodes 1 and 2 each hold one slow GPU, so 6 full-speed slots and two
    # degraded ones (0.5 and 0.25, fastest first).
    cluster = build_cluster_state(4, 8, [], [("1:3", 0.5), ("2:6", 0.25)])
    inventory = slot_inventory(cluster, 4)
    assert inventory.full_speed_count == 6 and [slot.speed for slot in inventory.degraded] == [0.5, 0.25]
    assert forced_slow(_shape(dp=2, pp=3), inventory) == ForcedSlow()  # 6 slots: all full speed
    assert forced_slow(_shape(dp=7, pp=1), inventory) == ForcedSlow(1, 0.5)  # 7 slots: one degraded
    assert forced_slow(_shape(dp=4, pp=2), inventory) == ForcedSlow(1, 0.5)  # 2 degraded over 4 replicas
    assert forced_slow(_shape(dp=1, pp=8), inventory) == ForcedSlow(2, 0.5)  # both in the one replica


def test_a_shape_forced_onto_a_slow_gpu_is_bounded_above_its_full_speed_floor():
    """On 2 x 4 GPUs with one at 0.25x, every tp 1 shape using all 8 GPUs runs a 0.25x stage: its bound must not
    fall below the same shape's on a healthy cluster, and single-stage replicas running several microbatches (one
    of them the 0.25x GPU alone, at 4x the compute) must rise well above it; shapes with a spare GPU keep it."""
    slow = {c.shape: c.lower_bound_ms for c in ranked_candidates(small_problem(slow=(("1:2", 0.25),),
                                                                               global_batch=32))[0]}
    healthy = {c.shape: c.lower_bound_ms for c in ranked_candidates(small_problem(global_batch=32))[0]}
    full = [shape for shape in slow if shape.tp == 1 and shape.cp == 1 and shape.dp * shape.pp == 8]
    spare = [shape for shape in slow if shape.tp == 1 and shape.cp == 1 and shape.dp * shape.pp <= 7]
    single = [shape for shape in full if shape.pp == 1 and shape.num_microbatches(32) >= 4]
    assert single and spare
    assert all(slow[shape] >= healthy[shape] for shape in full)
    assert all(slow[shape] > 2 * healthy[shape] for shape in single)
    assert all(slow[shape] == healthy[shape] for shape in spare)
