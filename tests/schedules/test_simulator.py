"""The simulator against numbers derived by hand, and against broken schedules.

Notation: p stages, m microbatches, F/B/I/W per-microbatch op times, L the
p2p latency. Every expected number below comes from the derivation in the
comment next to it, not from running the code.
"""

from __future__ import annotations

import pytest

from planner.schedules.handcrafted import gpipe, one_f_one_b
from planner.schedules.ops import ChunkTimes, Op, PipelineSpec, Schedule, ScheduleError
from planner.schedules.simulator import simulate


def uniform(p: int, m: int, f: float = 1.0, i: float = 2.0, w: float = 0.0, *, v: int = 1,
            latency: float = 0.0, gib: float = 0.0) -> PipelineSpec:
    """p equal stages with v equal chunks; B = I + W."""
    return PipelineSpec(tuple((ChunkTimes(f, i, w, gib),) * v for _ in range(p)), m, latency)


def ops(labels: str) -> tuple[Op, ...]:
    """`"F0 F1 B0"` -> (Op("F", 0), Op("F", 1), Op("B", 0)); `F0.1` is chunk 1."""
    result = []
    for label in labels.split():
        mb, _, chunk = label[1:].partition(".")
        result.append(Op(label[0], int(mb), int(chunk or 0)))
    return tuple(result)


# --- makespans on equal stages (F = 1, B = 2) ------------------------------------------------

# Lower bound for ANY order: the last stage cannot start before (p-1)F (its
# first input crosses p-1 stages), it has m(F+B) of work, and the gradient of
# its last backward still has to cross p-1 stages: (p-1)F + m(F+B) + (p-1)B
# = (m+p-1)(F+B). 1F1B meets it: when the last stage ends B(k-1) at T, stage
# p-2 runs B(k-1) then F(k+1), which is ready at T + B + F, exactly when the
# last stage has run F(k) and B(k); and stage s runs each B as soon as stage
# s+1 has, so the last gradient climbs without waiting.
# F=1, B=2 -> 3(m+p-1); e.g. p=4, m=8 -> 33; m < p included (the chain argument
# does not need the steady state).
@pytest.mark.parametrize(("p", "m"), [(1, 1), (1, 5), (2, 1), (3, 2), (4, 4), (4, 8), (5, 3), (8, 16)])
def test_one_f_one_b_equal_stages_makespan(p, m):
    assert simulate(one_f_one_b(p, m), uniform(p, m)).makespan_ms == pytest.approx(3 * (m + p - 1))


def test_one_f_one_b_worked_example():
    # p=4, m=8: 3 * (8 + 4 - 1) = 33.
    assert simulate(one_f_one_b(4, 8), uniform(4, 8)).makespan_ms == pytest.approx(33.0)


# GPipe meets the same bound: stage 0 emits a forward every F, so the last
# stage runs its m forwards back to back from (p-1)F, then its m backwards;
# each stage above runs B(k) one B after the stage below, so stage 0 ends
# (p-1)B after the last stage: (p-1)F + mF + mB + (p-1)B = (m+p-1)(F+B).
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 1), (3, 5), (4, 8), (6, 2)])
def test_gpipe_equal_stages_makespan(p, m):
    assert simulate(gpipe(p, m), uniform(p, m)).makespan_ms == pytest.approx(3 * (m + p - 1))


# --- p2p latency --------------------------------------------------------------------------------

# GPipe: the path above crosses p-1 links going down and p-1 coming back, and
# nothing else waits on a link (a stage's later forwards arrive F apart while
# it is still busy), so latency adds exactly 2(p-1)L: p=4, L=0.25 -> +1.5.
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gpipe_latency_adds_one_round_trip(m):
    p, latency = 4, 0.25
    result = simulate(gpipe(p, m), uniform(p, m, latency=latency))
    assert result.makespan_ms == pytest.approx(3 * (m + p - 1) + 2 * (p - 1) * latency)


# 1F1B with m <= 2: every stage but the last holds >= 2 microbatches, so no
# stage ever waits for a round trip except the fill and the drain: +2(p-1)L.
@pytest.mark.parametrize(("p", "m"), [(2, 1), (3, 2), (5, 1), (5, 2)])
def test_one_f_one_b_latency_fill_and_drain(p, m):
    latency = 0.5
    result = simulate(one_f_one_b(p, m), uniform(p, m, latency=latency))
    assert result.makespan_ms == pytest.approx(3 * (m + p - 1) + 2 * (p - 1) * latency)


# With more microbatches 1F1B pays latency in the steady state too, because
# stage s holds only p - s microbatches. p=2, F=1, B=2, stage 0 holds 2:
#   stage 0: F0 [0,1] F1 [1,2]; stage 1: F0 [1+L, 2+L] B0 [2+L, 4+L] F1 [4+L, 5+L] B1 [5+L, 7+L]
#   stage 0: B0 waits for G0 at 4+2L -> [4+2L, 6+2L], F2 [6+2L, 7+2L], B1 [7+2L, 9+2L] ...
# so each pair of microbatches takes 6 + 2L on stage 0 instead of 6: for even m
# the makespan is 3(m+1) + mL (m=2: 9 + 2L, the fill+drain case above).
@pytest.mark.parametrize("m", [2, 4, 6, 10])
def test_one_f_one_b_latency_in_steady_state(m):
    latency = 0.5
    result = simulate(one_f_one_b(2, m), uniform(2, m, latency=latency))
    assert result.makespan_ms == pytest.approx(3 * (m + 1) + m * latency)


# --- one slow stage -----------------------------------------------------------------------------

# Last stage 1.5x slower (F=1.5, B=3). It cannot start before (p-1)*1, then it
# is the bottleneck and runs 4.5m back to back (stage p-2 delivers F(k+1) by
# the end of B(k-1) on the last stage + 2 + 1, i.e. 1.5 before it is needed),
# and its last gradient climbs p-1 stages of B=2: 4.5m + (p-1) + 2(p-1).
# p=4, m=8 -> 36 + 9 = 45.
@pytest.mark.parametrize(("p", "m"), [(2, 3), (4, 8), (5, 5)])
def test_one_f_one_b_slow_last_stage(p, m):
    times = [ChunkTimes(1.0, 2.0, 0.0)] * (p - 1) + [ChunkTimes(1.5, 3.0, 0.0)]
    spec = PipelineSpec(tuple((t,) for t in times), m)
    assert simulate(one_f_one_b(p, m), spec).makespan_ms == pytest.approx(4.5 * m + 3 * (p - 1))


# First stage 1.5x slower, m >= p. Stage 0 runs its p warm-up forwards in 1.5p;
# the gradient of microbatch 0 returns after 1.5 + (p-1)*1 + (p-1)*2, so stage 0
# idles 1.5 + 3(p-1) - 1.5p = 1.5(p-1) once, then stays the bottleneck (every
# later gradient is back before it is needed): 4.5m + 1.5(p-1).
# p=4, m=8 -> 36 + 4.5 = 40.5.
@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 8), (3, 7)])
def test_one_f_one_b_slow_first_stage(p, m):
    times = [ChunkTimes(1.5, 3.0, 0.0)] + [ChunkTimes(1.0, 2.0, 0.0)] * (p - 1)
    spec = PipelineSpec(tuple((t,) for t in times), m)
    assert simulate(one_f_one_b(p, m), spec).makespan_ms == pytest.approx(4.5 * m + 1.5 * (p - 1))


# --- memory, busy and idle ------------------------------------------------------------------------

# 1F1B: stage s runs min(p-s-1, m) warm-up forwards, then each round adds one
# forward before it retires one backward: peak min(p-s, m). GPipe: all m.
@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 2), (1, 3), (6, 6)])
def test_peak_in_flight(p, m):
    assert simulate(one_f_one_b(p, m), uniform(p, m)).peak_in_flight == tuple(min(p - s, m) for s in range(p))
    assert simulate(gpipe(p, m), uniform(p, m)).peak_in_flight == (m,) * p


def test_busy_idle_and_bubble():
    # p=4, m=8, F=1, B=2: every stage works m(F+B) = 24 of the makespan 33, so
    # idles 9; the bubble is 9 = (p-1)(F+B) and its share 9/33 = (p-1)/(m+p-1).
    result = simulate(one_f_one_b(4, 8), uniform(4, 8))
    assert result.busy_ms == pytest.approx((24.0,) * 4)
    assert result.idle_ms == pytest.approx((9.0,) * 4)
    assert sum(result.busy_ms) + sum(result.idle_ms) == pytest.approx(4 * result.makespan_ms)
    assert result.bubble_ms == pytest.approx(9.0)
    assert result.bubble_fraction == pytest.approx(9 / 33)


def test_busy_counts_each_op_once_with_split_backward():
    # F=1, I=1, W=2 per microbatch: 4 per microbatch, m=3 -> 12 per stage.
    schedule = Schedule("split", (ops("F0 F1 F2 I0 W0 I1 W1 I2 W2"),) * 2)
    result = simulate(schedule, uniform(2, 3, f=1.0, i=1.0, w=2.0))
    assert result.busy_ms == pytest.approx((12.0, 12.0))


def test_peak_activation_gib_uses_each_stage_size():
    # 1F1B, p=3, m=6: alive min(3-s, 6) = 3, 2, 1 microbatches of 0.5, 1 and 2 GiB.
    spec = PipelineSpec(tuple((ChunkTimes(1.0, 2.0, 0.0, gib),) for gib in (0.5, 1.0, 2.0)), 6)
    assert simulate(one_f_one_b(3, 6), spec).peak_activation_gib == pytest.approx((1.5, 2.0, 2.0))
    # GPipe keeps all 6: 3, 6 and 12 GiB.
    assert simulate(gpipe(3, 6), spec).peak_activation_gib == pytest.approx((3.0, 6.0, 12.0))


def test_peak_activation_gib_per_chunk_and_over_memory():
    # One stage, two chunks of 0.25 and 0.75 GiB, two microbatches.
    chunks = ((ChunkTimes(1.0, 1.0, 0.0, 0.25), ChunkTimes(1.0, 1.0, 0.0, 0.75)),)
    spec = PipelineSpec(chunks, 2, activation_limit_gib=(1.5,))
    # Both microbatches through both chunks before any backward: 2 * (0.25 + 0.75) = 2.
    breadth_first = Schedule("bfs", (ops("F0 F0.1 F1 F1.1 B1.1 B1 B0.1 B0"),))
    # One microbatch at a time: 0.25 + 0.75 = 1.
    depth_first = Schedule("dfs", (ops("F0 F0.1 B0.1 B0 F1 F1.1 B1.1 B1"),))
    assert simulate(breadth_first, spec).peak_activation_gib == pytest.approx((2.0,))
    assert simulate(depth_first, spec).peak_activation_gib == pytest.approx((1.0,))
    assert simulate(breadth_first, spec).over_memory(spec) == (0,)
    assert simulate(depth_first, spec).over_memory(spec) == ()


def test_weight_gradient_keeps_activations_alive():
    # Alive from F start to W end: deferring both W's holds 2 microbatches, W right after I holds 1.
    spec = uniform(1, 2, f=1.0, i=1.0, w=1.0, gib=1.0)
    deferred = Schedule("deferred", (ops("F0 I0 F1 I1 W0 W1"),))
    in_place = Schedule("in-place", (ops("F0 I0 W0 F1 I1 W1"),))
    assert simulate(deferred, spec).peak_in_flight == (2,)
    assert simulate(in_place, spec).peak_in_flight == (1,)


# --- broken schedules ----------------------------------------------------------------------------

def test_rejects_backward_before_its_own_forward():
    # Stage 1 (the last) runs B0 before F0: B0 waits for its own later F0.
    schedule = Schedule("broken", (ops("F0 F1 B0 B1"), ops("B0 F0 B1 F1")))
    with pytest.raises(ScheduleError, match="deadlocks.*stage 1 waits at B0"):
        simulate(schedule, uniform(2, 2))


def test_rejects_two_stages_waiting_on_each_other():
    # Stage 1's F1 needs stage 0's F1, which comes after stage 0's B0, which
    # needs stage 1's B0, which comes after stage 1's F1.
    schedule = Schedule("cycle", (ops("F0 B0 F1 B1"), ops("F0 F1 B0 B1")))
    with pytest.raises(ScheduleError, match="deadlocks") as error:
        simulate(schedule, uniform(2, 2))
    assert "stage 0 waits at B0" in str(error.value) and "stage 1 waits at F1" in str(error.value)


def test_rejects_weight_gradient_before_its_input_gradient():
    schedule = Schedule("w-first", (ops("F0 W0 I0"),))
    with pytest.raises(ScheduleError, match="deadlocks.*stage 0 waits at W0"):
        simulate(schedule, uniform(1, 1))


@pytest.mark.parametrize(
    ("orders", "m", "message"),
    [
        ((ops("F0 F1 B0"), ops("F0 B0 F1 B1")), 2, "stage 0: microbatch 1 has no B1"),
        ((ops("F0 B0 F1 B1"), ops("F0 B0 B1")), 2, "stage 1: microbatch 1 has no forward F1"),
        ((ops("F0 F0 B0"), ops("F0 B0")), 1, "stage 0: F0 appears 2 times"),
        ((ops("F0 B0 I0 W0"), ops("F0 B0")), 1, "stage 0: microbatch 0 has both B and I/W"),
        ((ops("F0 I0"), ops("F0 I0 W0")), 1, "stage 0: microbatch 0 has no W0"),
        ((ops("F0 W0"), ops("F0 I0 W0")), 1, "stage 0: microbatch 0 has no I0"),
        ((ops("F0 B0 F5 B5"), ops("F0 B0")), 1, "stage 0: F5 is outside 1 microbatches x 1 chunks"),
        ((ops("F0 B0 F0.1 B0.1"), ops("F0 B0")), 1, r"stage 0: F0\.1 is outside"),
        ((ops("F0 B0"), ops("F0 B0"), ops("F0 B0")), 1, "has 3 stages, the pipeline 2"),
    ],
)
def test_rejects_incomplete_or_malformed_schedules(orders, m, message):
    with pytest.raises(ScheduleError, match=message):
        simulate(Schedule("broken", orders), uniform(2, m))


def test_rejects_unknown_operation_kind():
    # Op does not check its kind; before validation did, an "X" ran as a backward.
    schedule = Schedule("typo", (ops("F0 B0") + (Op("X", 0),),))
    with pytest.raises(ScheduleError, match="X0 is not an F, B, I or W operation"):
        simulate(schedule, uniform(1, 1))
