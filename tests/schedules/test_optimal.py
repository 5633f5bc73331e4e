"""The CP-SAT schedule optimizer against exhaustive enumeration, hand-derived bounds and the handcrafted orders.

Brute force: every per-stage order that keeps each microbatch's own ops in
dependency order (F before B, or F before I before W), simulated; orders
that deadlock are skipped. The simulator starts every op as early as its
order allows, and any timetable is matched or beaten by simulating its own
per-stage order, so the minimum over all orders is the true optimum. The
enumeration does not assume microbatches run in index order, so it also
checks the optimizer's symmetry breaking. Solver: seed 0, one worker.
"""

from __future__ import annotations

import itertools

import pytest

from planner.schedules.bounds import lower_bound_ms
from planner.schedules.handcrafted import one_f_one_b, zb_h1
from planner.schedules.list_scheduling import with_backward
from planner.schedules.ops import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    ChunkTimes,
    Op,
    PipelineSpec,
    Schedule,
    ScheduleError,
)
from planner.schedules.optimal import OPTIMIZED, optimize_schedule
from planner.schedules.simulator import simulate

TOLERANCE = 1e-6


def spec_of(stage_times, microbatches, latency=0.0, cap=None, activation=1.0):
    """One chunk per stage; stage_times[s] = (F, I, W) ms; cap in microbatches on every stage."""
    chunks = tuple((ChunkTimes(f, i, w, activation),) for f, i, w in stage_times)
    limit = None if cap is None else (cap * activation,) * len(stage_times)
    return PipelineSpec(chunks, microbatches, latency, limit)


def optimize(spec, split, **kwargs):
    kwargs.setdefault("time_limit_s", 5.0)
    return optimize_schedule(spec, split_backward=split, seed=0, workers=1, **kwargs)


def stage_orders(microbatches, chunks, split):
    """Every order of one stage's ops with each (microbatch, chunk)'s chain F -> B (or F -> I -> W) kept."""
    chain = (FORWARD, INPUT_GRAD, WEIGHT_GRAD) if split else (FORWARD, BACKWARD)
    owners = [(mb, c) for mb in range(microbatches) for c in range(chunks)]

    def extend(progress, prefix):
        if len(prefix) == len(owners) * len(chain):
            yield tuple(prefix)
            return
        for n, (mb, c) in enumerate(owners):
            if progress[n] < len(chain):
                prefix.append(Op(chain[progress[n]], mb, c))
                progress[n] += 1
                yield from extend(progress, prefix)
                progress[n] -= 1
                prefix.pop()

    return list(extend([0] * len(owners), []))


def brute_force_ms(spec, split):
    """Least simulated makespan over all orders (that fit the spec's activation cap)."""
    per_stage = stage_orders(spec.num_microbatches, spec.virtual_stages, split)
    best = float("inf")
    for orders in itertools.product(per_stage, repeat=spec.num_stages):
        try:
            run = simulate(Schedule("brute", orders), spec)
        except ScheduleError:
            continue  # deadlock
        if not run.over_memory(spec):
            best = min(best, run.makespan_ms)
    return best


def check_result(result, spec):
    """The returned order runs, within memory, no slower than the reported objective."""
    assert result is not None
    assert result.schedule.name == OPTIMIZED
    run = simulate(result.schedule, spec)
    assert run.makespan_ms == pytest.approx(result.makespan_ms)
    assert run.makespan_ms <= result.objective_ms + TOLERANCE
    assert not run.over_memory(spec)
    assert result.makespan_ms >= result.lower_bound_ms - TOLERANCE
    return run


# Tiny instances: (stage F, I, W times, microbatches, latency, cap in microbatches, split).
TINY = {
    "p2 m2 B latency": ([(1.0, 1.0, 1.0), (2.0, 1.5, 1.0)], 2, 0.25, None, False),
    "p2 m3 B slow first stage": ([(2.0, 2.0, 2.0), (1.0, 1.0, 1.0)], 3, 0.0, None, False),
    "p3 m2 B slow middle, latency": ([(1.0, 1.0, 1.0), (1.5, 1.5, 1.5), (1.0, 1.0, 1.0)], 2, 0.5, None, False),
    "p2 m3 B cap 2": ([(1.0, 1.0, 1.0), (1.0, 2.0, 1.0)], 3, 0.0, 2, False),
    "p2 m2 I/W slow last stage": ([(1.0, 1.0, 1.0), (2.0, 2.0, 1.0)], 2, 0.0, None, True),
    "p3 m2 I/W latency": ([(1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (1.0, 1.0, 1.0)], 2, 0.25, None, True),
    "p2 m2 I/W cap 1": ([(1.0, 1.0, 1.0), (1.0, 1.0, 1.0)], 2, 0.0, 1, True),
}


@pytest.fixture(scope="module")
def brute_force():
    cache = {}

    def get(name):
        if name not in cache:
            times, m, latency, cap, split = TINY[name]
            cache[name] = brute_force_ms(spec_of(times, m, latency, cap), split)
        return cache[name]

    return get


@pytest.mark.parametrize("warm_start", [False, True], ids=["cp-sat only", "warm start"])
@pytest.mark.parametrize("name", list(TINY))
def test_tiny_instances_match_brute_force(name, warm_start, brute_force):
    times, m, latency, cap, split = TINY[name]
    spec = spec_of(times, m, latency, cap)
    result = optimize(spec, split, warm_start=warm_start)
    check_result(result, spec)
    assert result.status == "OPTIMAL" and result.exact
    assert result.makespan_ms == pytest.approx(brute_force(name))
    assert result.objective_ms == pytest.approx(brute_force(name))
    assert lower_bound_ms(spec, split_backward=split) <= brute_force(name) + TOLERANCE


def test_interleaved_single_stage_matches_brute_force():
    """One stage, two chunks (virtual stages 0 and 1 on the same GPU), cap 3 chunk-activations: the cumulative path."""
    chunks = ((ChunkTimes(1.0, 2.0, 1.0, 1.0), ChunkTimes(2.0, 1.0, 1.0, 2.0)),)
    spec = PipelineSpec(chunks, 2, 0.0, (4.0,))
    expected = brute_force_ms(spec, False)
    for warm_start in (False, True):
        result = optimize(spec, False, warm_start=warm_start)
        check_result(result, spec)
        assert result.status == "OPTIMAL"
        assert result.makespan_ms == pytest.approx(expected)


def test_lower_bound_equal_stages_hand_derived():
    """p = 4, m = 8, F = I = W = 1, no latency.

    Split: the last stage cannot start before 3 (head) and has 24 of work;
    its drain (3 I's upstream + W on stage 0 = 4) hides behind its 8 W's:
    3 + 24 = 27 = (p-1)F + m(F+I+W), which ZB-H2 reaches. Full backward:
    the last stage's 24 plus head 3 plus the B chain down to stage 0,
    3 x 2 = 6: 33 = (m+p-1)(F+B), 1F1B's makespan.
    """
    spec = spec_of([(1.0, 1.0, 1.0)] * 4, 8)
    assert lower_bound_ms(spec) == pytest.approx(27.0)
    assert lower_bound_ms(spec, split_backward=False) == pytest.approx(33.0)
    assert simulate(one_f_one_b(4, 8), spec).makespan_ms == pytest.approx(33.0)


def test_lower_bound_single_microbatch_is_the_critical_path():
    """p = 2, m = 1, L = 0.5: F0 1, L, F1 1, I1 1, L, I0 1, W0 1 = 6 (full: F F B B with two latencies = 7)."""
    spec = spec_of([(1.0, 1.0, 1.0)] * 2, 1, latency=0.5)
    assert lower_bound_ms(spec) == pytest.approx(6.0)
    assert lower_bound_ms(spec, split_backward=False) == pytest.approx(7.0)
    assert optimize(spec, True).makespan_ms == pytest.approx(6.0)


def test_lower_bound_with_memory_cap_hand_derived():
    """p = 2, m = 4, F = 1, B = 2, cap 1: stage 0 serves one microbatch at a time, each a 6 ms round trip: 24."""
    spec = spec_of([(1.0, 1.0, 1.0)] * 2, 4, cap=1)
    assert lower_bound_ms(spec, split_backward=False) == pytest.approx(24.0)
    result = optimize(spec, False)
    check_result(result, spec)
    assert result.makespan_ms == pytest.approx(24.0)


def test_lower_bound_cap_below_one_microbatch_is_infinite():
    spec = spec_of([(1.0, 1.0, 1.0)] * 2, 2, cap=0.5)
    assert lower_bound_ms(spec) == float("inf")
    assert optimize(spec, True) is None


def test_slow_first_stage_beats_1f1b():
    """p = 2, m = 3; stage 0 takes F = 2, B = 4, stage 1 F = 1, B = 2.

    Stage 0 has 18 ms of work and nothing forces it to wait: F0 F1 F2 B0 B1
    B2 runs back to back (B0's gradient is back at 5 < 6), so 18 is optimal
    and equals the lower bound. 1F1B stage 0 runs only p - s = 2 forwards
    before B0: F0 [0,2], F1 [2,4], then waits for B0's gradient (stage 1:
    F0 [2,3], B0 [3,5]), B0 [5,9]: one ms idle on the bottleneck stage, and
    stage 0 stays busy afterwards (F2 [9,11], B1 [11,15], B2 [15,19]): 19.
    """
    spec = spec_of([(2.0, 2.0, 2.0), (1.0, 1.0, 1.0)], 3)
    assert lower_bound_ms(spec, split_backward=False) == pytest.approx(18.0)
    assert simulate(one_f_one_b(2, 3), spec).makespan_ms == pytest.approx(19.0)
    result = optimize(spec, False, hint=one_f_one_b(2, 3), warm_start=False)
    check_result(result, spec)
    assert result.makespan_ms == pytest.approx(18.0) and result.status == "OPTIMAL"


@pytest.mark.parametrize("split", [False, True], ids=["B", "I/W"])
def test_memory_cap_holds(split):
    """Cap of 2 microbatches on 3 stages (the first stage's 1F1B peak would be 3)."""
    spec = spec_of([(1.0, 1.0, 1.0), (1.5, 1.5, 1.5), (1.0, 1.0, 1.0)], 6, latency=0.1, cap=2)
    result = optimize(spec, split, time_limit_s=2.0)
    run = check_result(result, spec)
    assert max(run.peak_in_flight) <= 2


def test_interleaved_memory_cap_holds():
    """v = 2 (cumulative over both chunks): at most 4 microbatch-chunks alive per stage."""
    chunks = tuple((ChunkTimes(1.0, 1.0, 1.0, 1.0), ChunkTimes(1.0, 1.0, 1.0, 1.0)) for _ in range(2))
    spec = PipelineSpec(chunks, 4, 0.0, (4.0, 4.0))
    result = optimize(spec, False, time_limit_s=2.0)
    run = check_result(result, spec)
    assert max(run.peak_in_flight) <= 4


@pytest.mark.parametrize("split", [False, True], ids=["B", "I/W"])
def test_never_worse_than_the_hint(split):
    """Even when the solver has almost no time, the hint is the floor (converted to the backward form; fits the cap)."""
    spec = spec_of([(1.0, 1.0, 1.0)] * 2 + [(1.5, 1.5, 1.5)] + [(1.0, 1.0, 1.0)], 8, latency=0.05, cap=4)
    hint = zb_h1(4, 8) if split else one_f_one_b(4, 8)
    hinted = simulate(hint, spec).makespan_ms
    for time_limit_s in (0.01, 1.0):
        result = optimize(spec, split, hint=hint, warm_start=False, time_limit_s=time_limit_s)
        check_result(result, spec)
        assert result.makespan_ms <= hinted + TOLERANCE
    result = optimize(spec, split, hint=hint)
    assert result.makespan_ms <= hinted + TOLERANCE


def test_rounded_times_still_run_within_the_objective():
    """Times that are not whole ticks are rounded up in the model, so the simulated order is never slower."""
    spec = spec_of([(1.0 / 3, 2.0 / 3, 0.3333), (0.7071, 1.4142, 0.5)], 3, latency=0.0123)
    result = optimize(spec, True, warm_start=False)
    check_result(result, spec)
    assert not result.exact


def test_with_backward_round_trip():
    schedule = one_f_one_b(3, 4)
    split = with_backward(schedule, True)
    assert split.splits_backward
    assert with_backward(split, False).orders == schedule.orders
    spec = spec_of([(1.0, 1.0, 1.0)] * 3, 4)
    assert simulate(split, spec).makespan_ms <= simulate(schedule, spec).makespan_ms


def test_deterministic():
    spec = spec_of([(1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (1.0, 1.0, 1.0)], 4, latency=0.2, cap=2)
    first = optimize(spec, True, warm_start=False)
    second = optimize(spec, True, warm_start=False)
    assert first.schedule == second.schedule and first.status == second.status
