"""Pipeline makespan and bubble (Narayanan et al. SC'21 sec. 2.2)."""

from __future__ import annotations

import pytest

from cost_models.pipeline import bubble_fraction, pipeline_time_ms


@pytest.mark.parametrize("p,m,t", [(1, 1, 3.0), (4, 8, 2.5), (8, 64, 1.0), (16, 4, 7.0)])
def test_equal_stages_1f1b(p, m, t):
    # (m + p - 1) t: m steady slots plus p - 1 fill/drain slots
    assert pipeline_time_ms([t] * p, m) == pytest.approx((m + p - 1) * t, rel=1e-12)


@pytest.mark.parametrize("p,m,v,t", [(4, 8, 2, 2.0), (8, 32, 4, 1.5), (2, 2, 3, 10.0)])
def test_equal_stages_interleaved(p, m, v, t):
    # interleaving shrinks the bubble v-fold: (m + (p - 1)/v) t
    assert pipeline_time_ms([t] * p, m, v) == pytest.approx((m + (p - 1) / v) * t, rel=1e-12)


def test_unequal_stages():
    times = [3.0, 5.0, 2.0, 4.0]
    m = 8
    # bottleneck runs m back to back: 8 * 5; the others fill/drain: 3 + 2 + 4 = 9
    assert pipeline_time_ms(times, m) == pytest.approx(8 * 5 + 9, rel=1e-12)
    # interleaved v = 2: 40 + 9/2
    assert pipeline_time_ms(times, m, 2) == pytest.approx(40 + 4.5, rel=1e-12)
    # order of stages does not matter
    assert pipeline_time_ms(list(reversed(times)), m) == pytest.approx(49.0, rel=1e-12)


def test_empty_pipeline_is_zero():
    assert pipeline_time_ms([], 8) == 0.0


@pytest.mark.parametrize("p,m,v", [(4, 8, 1), (4, 8, 2), (8, 16, 1), (1, 5, 1), (16, 128, 4)])
def test_bubble_fraction(p, m, v):
    # textbook (p - 1)/(v m)
    assert bubble_fraction(p, m, v) == pytest.approx((p - 1) / (v * m), rel=1e-12)
    # consistent with the makespan for equal stages: (T - m t)/(m t)
    t = 2.0
    ideal = m * t
    assert (pipeline_time_ms([t] * p, m, v) - ideal) / ideal == pytest.approx((p - 1) / (v * m), rel=1e-12)
