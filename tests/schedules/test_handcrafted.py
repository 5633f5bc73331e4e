"""Handcrafted schedule orders: they run, hold the memory they promise, and hit hand-derived makespans.

Notation: p stages, m microbatches, stage s in 0..p-1, F/B/I/W per-microbatch
op times (B = I + W), v chunks per stage with per-chunk times f and b.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.schedules.handcrafted import (
    gpipe,
    handcrafted_schedules,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
    zb_h2,
)
from planner.schedules.ops import ChunkTimes, Op, PipelineSpec, ScheduleError
from planner.schedules.simulator import simulate

SINGLE_CHUNK = (gpipe, one_f_one_b, zb_h1, zb_h2)


def uniform(p: int, m: int, f: float = 1.0, i: float = 1.0, w: float = 1.0, *, v: int = 1) -> PipelineSpec:
    return PipelineSpec(tuple((ChunkTimes(f, i, w),) * v for _ in range(p)), m)


def labels(order: tuple[Op, ...]) -> str:
    return " ".join(op.label() for op in order)


# --- the orders themselves, written out by hand -----------------------------------------------

def test_one_f_one_b_order_is_megatrons():
    # p=4, stage 1: warm-up p-s-1 = 2 forwards, 1F1B rounds, then the last 2 backwards.
    assert labels(one_f_one_b(4, 6).orders[1]) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"
    # The last stage has no warm-up; with m < p - s the warm-up is all m forwards.
    assert labels(one_f_one_b(4, 3).orders[3]) == "F0 B0 F1 B1 F2 B2"
    assert labels(one_f_one_b(4, 2).orders[0]) == "F0 F1 B0 B1"


def test_gpipe_order():
    assert labels(gpipe(3, 3).orders[2]) == "F0 F1 F2 B0 B1 B2"


def test_zero_bubble_orders():
    # ZB-H1 is 1F1B with every B split into I then W in place.
    assert labels(zb_h1(2, 3).orders[0]) == "F0 F1 I0 W0 F2 I1 W1 I2 W2"
    # ZB-H2, p=2: stage 0 runs 2p-1 = 3 forwards first, W right after I (lag 0);
    # stage 1 runs 1 forward first and lets each W trail its I by 1.
    assert labels(zb_h2(2, 4).orders[0]) == "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3"
    assert labels(zb_h2(2, 4).orders[1]) == "F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3"


def test_interleaved_order_is_megatrons():
    # p=2, v=2, m=4: groups of p=2 microbatches go through chunk 0 then chunk 1.
    # Stage 0 warms up with 2(p-1) + (v-1)p = 4 forwards, then 4 rounds, then 4 backwards
    # in the forward table's order with the chunks reversed.
    assert labels(interleaved_1f1b(2, 4, 2).orders[0]) == (
        "F0 F1 F0.1 F1.1 "
        "F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 "
        "B2.1 B3.1 B2 B3"
    )
    # Stage 1: warm-up (v-1)p = 2.
    assert labels(interleaved_1f1b(2, 4, 2).orders[1]) == (
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"
    )


def test_builders_are_pure():
    assert zb_h2(5, 9) == zb_h2(5, 9)
    assert interleaved_1f1b(3, 7, 3) == interleaved_1f1b(3, 7, 3)


@pytest.mark.parametrize("build", SINGLE_CHUNK)
def test_builders_reject_empty_shapes(build):
    with pytest.raises(ScheduleError, match="at least 1 stage and 1 microbatch"):
        build(0, 4)
    with pytest.raises(ScheduleError, match="at least 1 stage and 1 microbatch"):
        build(4, 0)


def test_interleaved_needs_two_chunks():
    with pytest.raises(ScheduleError, match="at least 2 chunks"):
        interleaved_1f1b(4, 8, 1)


def test_handcrafted_schedules_follow_the_chunk_placement():
    assert [s.name for s in handcrafted_schedules(uniform(4, 8))] == ["gpipe", "1f1b", "zb-h1", "zb-h2"]
    assert [s.name for s in handcrafted_schedules(uniform(4, 8, v=2))] == ["interleaved", "looped-bfs"]


# --- every shape runs ---------------------------------------------------------------------------

# The full grid p <= 16, m <= 64 (and v <= 4 for interleaved) was checked once
# offline; deadlock-freedom does not depend on times, so a spread of shapes
# with m < p, m = p, m just above multiples of p and the extremes is kept here.
GRID = [(p, m) for p in (1, 2, 3, 4, 5, 8, 16) for m in (1, 2, 3, 5, 8, 15, 16, 17, 33, 64)]


@pytest.mark.parametrize(("p", "m"), GRID)
def test_single_chunk_schedules_run_every_shape(p, m):
    spec = uniform(p, m)
    for schedule in handcrafted_schedules(spec):
        simulate(schedule, spec)


# Includes p=5, m=7 (v=2, 3) and p=4, m=5 (v=3), where splitting the
# microbatches into groups of p plus a trailing group of m % p deadlocks.
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize(("p", "m"), [(p, m) for p in (1, 2, 4, 5, 8) for m in (1, 2, 3, 5, 7, 8, 9, 13, 16, 17)])
def test_interleaved_runs_every_shape(p, m, v):
    simulate(interleaved_1f1b(p, m, v), uniform(p, m, v=v))


# --- memory ---------------------------------------------------------------------------------------

# Alive = from F start to W (or B) end. 1F1B and ZB-H1: stage s starts with
# min(p-s, m) forwards before its first backward, and from then on every
# forward follows the retirement of one microbatch (ZB-H1's W runs right after
# its I): peak min(p-s, m). ZB-H2: min(2(p-s)-1, m) forwards first, and each W
# trails its I by s backwards, i.e. s more alive: min(2p-1-s, m) <= 2p - 1.
# GPipe: all m.
@pytest.mark.parametrize(("p", "m"), [(1, 4), (2, 7), (4, 3), (4, 8), (6, 20)])
def test_peak_in_flight(p, m):
    spec = uniform(p, m)
    expected = {
        "gpipe": tuple(m for s in range(p)),
        "1f1b": tuple(min(p - s, m) for s in range(p)),
        "zb-h1": tuple(min(p - s, m) for s in range(p)),
        "zb-h2": tuple(min(2 * p - 1 - s, m) for s in range(p)),
    }
    for schedule in handcrafted_schedules(spec):
        assert simulate(schedule, spec).peak_in_flight == expected[schedule.name], schedule.name


# Interleaved, m % p == 0: stage s warms up with 2(p-s-1) + (v-1)p chunk
# forwards and each round adds one before retiring one: peak that + 1, at most m*v.
@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (4, 4, 2), (2, 6, 3), (3, 3, 4)])
def test_interleaved_peak_in_flight(p, m, v):
    result = simulate(interleaved_1f1b(p, m, v), uniform(p, m, v=v))
    assert result.peak_in_flight == tuple(min(2 * (p - s - 1) + (v - 1) * p + 1, m * v) for s in range(p))


# --- makespans on equal stages ----------------------------------------------------------------

# ZB-H1 with F = I = W = t = 1. Any order whose last stage holds one microbatch
# (ZB-H1's memory: p - s alive) runs F I W there back to back, from (p-1)t at
# the earliest, so its I(m-1) ends >= (p-1) + 3m - 1; that gradient climbs p-1
# stages of I, then stage 0 still runs W(m-1): >= 3m + 2(p-1).
# ZB-H1 reaches it: each stage runs I(k) W(k) in 1F1B's B(k) slot, and
# the gradient arrives exactly when the previous W ends. Bubble (p-1)(F+I) = 2(p-1)
# against 1F1B's (p-1)(F+I+W) = 3(p-1); e.g. p=4, m=8: 30 vs 33.
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 1), (3, 2), (4, 4), (4, 8), (8, 16), (5, 23)])
def test_zb_h1_equal_stages_makespan(p, m):
    assert simulate(zb_h1(p, m), uniform(p, m)).makespan_ms == pytest.approx(3 * m + 2 * (p - 1))


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8), (8, 9)])
def test_zb_h1_beats_one_f_one_b_when_weight_gradients_cost_time(p, m):
    # 3m + 2(p-1) < 3(m+p-1) whenever p > 1 (1F1B: (m+p-1)(F+B), F=1, B=2).
    spec = uniform(p, m)
    assert simulate(zb_h1(p, m), spec).makespan_ms < simulate(one_f_one_b(p, m), spec).makespan_ms
    # Without a W to move, the split order is exactly 1F1B's.
    no_w = uniform(p, m, i=2.0, w=0.0)
    assert simulate(zb_h1(p, m), no_w).makespan_ms == pytest.approx(simulate(one_f_one_b(p, m), no_w).makespan_ms)


# ZB-H2 with F = I = W = 1 and m >= p. Lower bound for any order: the last
# stage starts at (p-1) and has 3m of work. ZB-H2 reaches it: stage s starts at
# s and runs 2(p-s)-1 forwards, ending at 2p-1-s, exactly when the gradient of
# microbatch 0 arrives (F reaches the last stage at p, I comes back p-1-s
# stages); every later round of I, W, F finds its inputs ready, and the s-step
# W lag lets the final I's climb without waiting. Makespan 3m + (p-1),
# i.e. m(F+I+W) + (p-1)F; p=4, m=8: 27 (ZB-H1 30, 1F1B 33).
@pytest.mark.parametrize(("p", "m"), [(1, 5), (2, 2), (4, 4), (4, 8), (5, 11), (8, 16)])
def test_zb_h2_equal_stages_makespan(p, m):
    assert simulate(zb_h2(p, m), uniform(p, m)).makespan_ms == pytest.approx(3 * m + (p - 1))


# Interleaved, per-chunk f = 1, b = 2, m % p == 0. Lower bound for any order:
# the last stage starts at (p-1)f, has m*v*(f+b) of work, and its last backward
# (chunk 0 of some microbatch, else the chain is even longer) still climbs p-1
# stages: (m*v + p - 1)(f+b). Megatron's warm-up of two ops per hop keeps the
# last stage busy from its start, so the order meets it: the bubble is
# (p-1)(f+b) = (p-1)(F+B)/v in whole-stage times F = v*f, B = v*b, a v-th of
# 1F1B's. v=2, p=4, m=8: 51 of makespan, bubble 9 (1F1B with F=2, B=4: 18).
@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 4, 2), (3, 9, 2), (4, 8, 3), (8, 16, 2)])
def test_interleaved_bubble(p, m, v):
    f, b = 1.0, 2.0
    result = simulate(interleaved_1f1b(p, m, v), uniform(p, m, f=f, i=b, w=0.0, v=v))
    assert result.makespan_ms == pytest.approx((m * v + p - 1) * (f + b))
    assert result.bubble_ms == pytest.approx((p - 1) * (v * f + v * b) / v)
    whole_stage = simulate(one_f_one_b(p, m), uniform(p, m, f=v * f, i=v * b, w=0.0))
    assert whole_stage.bubble_ms == pytest.approx(v * result.bubble_ms)


# The uneven groups used when m % p != 0 (m > p) still meet the same lower bound.
@pytest.mark.parametrize(("p", "m"), [(4, 5), (4, 6), (4, 9), (5, 7), (3, 10)])
def test_interleaved_uneven_groups_keep_the_bubble(p, m):
    result = simulate(interleaved_1f1b(p, m, 2), uniform(p, m, f=1.0, i=2.0, w=0.0, v=2))
    assert result.makespan_ms == pytest.approx((2 * m + p - 1) * 3.0)


# --- any stage times --------------------------------------------------------------------------------

def _one_microbatch_critical_path(spec: PipelineSpec, split: bool) -> float:
    """Forward through every virtual stage, back through every one, then the slowest-to-finish W."""
    p, v, latency = spec.num_stages, spec.virtual_stages, spec.p2p_latency_ms
    hop = latency if p > 1 else 0.0
    chunks = [spec.chunks[vs % p][vs // p] for vs in range(p * v)]
    arrive = sum(c.forward_ms for c in chunks) + hop * (p * v - 1)
    if not split:
        return arrive + sum(c.backward_ms for c in chunks) + hop * (p * v - 1)
    longest = 0.0
    for vs in reversed(range(p * v)):
        arrive += chunks[vs].input_grad_ms
        longest = max(longest, arrive + chunks[vs].weight_grad_ms)
        arrive += hop
    return longest


times = st.floats(0.1, 5.0, allow_nan=False, allow_infinity=False)


@given(
    p=st.integers(1, 5),
    m=st.integers(1, 10),
    v=st.sampled_from([1, 1, 2, 3]),
    latency=st.sampled_from([0.0, 0.0, 0.3]),
    data=st.data(),
)
def test_any_stage_times(p, m, v, latency, data):
    chunk = st.builds(ChunkTimes, times, times, st.one_of(st.just(0.0), times))
    chunks = tuple(tuple(data.draw(chunk) for _ in range(v)) for _ in range(p))
    spec = PipelineSpec(chunks, m, latency)
    makespans = {}
    for schedule in handcrafted_schedules(spec):
        result = simulate(schedule, spec)
        makespans[schedule.name] = result.makespan_ms
        # No stage can finish before doing its own work ...
        stage_work = max(sum(spec.times(s, op) for op in order) for s, order in enumerate(schedule.orders))
        assert result.makespan_ms >= stage_work - 1e-9
        # ... nor before one microbatch has gone down and back up the pipeline.
        assert result.makespan_ms >= _one_microbatch_critical_path(spec, schedule.splits_backward) - 1e-9
        assert max(result.peak_in_flight) <= (2 * p - 1 if schedule.name == "zb-h2" else m * v)
    if v == 1:
        # Same order with every B split into I then W in place: every op's inputs are
        # ready no later (I ends before B would, W ends when B would), so never slower.
        assert makespans["zb-h1"] <= makespans["1f1b"] + 1e-9
        assert simulate(one_f_one_b(p, m), spec).peak_in_flight == simulate(zb_h1(p, m), spec).peak_in_flight
