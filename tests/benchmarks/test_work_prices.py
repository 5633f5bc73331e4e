"""The work-price fit puts each stretch of CPU time down to the work charged at its end, and a fixed-price kind
(CP-SAT's deterministic time) takes no more than its own price's worth: the model built around it is priced
by what follows."""

from __future__ import annotations

import time

import pytest

from benchmarks import work_prices
from planner.work import PRICE_S, Work


def test_cpu_time_goes_to_the_work_charged_after_it(monkeypatch):
    readings = iter([10.0, 10.5, 12.0, 12.3, 13.3])  # thread CPU time at the clock's start and at each charge
    monkeypatch.setattr(time, "thread_time", lambda: next(readings))
    clock = work_prices._AttributingClock()
    clock.charge(Work.SHAPE, 1000)  # 0.5 s of shapes
    clock.charge(Work.CP_SAT, 1.0)  # 1.5 s passed, but a unit of CP-SAT is priced at one second ...
    clock.charge(Work.SPLIT_MODEL, 1)  # ... so the model gets the other 0.5 s, and its own 0.3 s
    clock.charge(Work.SHAPE, 1000)  # 1.0 s
    assert clock.cpu_s[Work.SHAPE] == pytest.approx(1.5)
    assert clock.cpu_s[Work.CP_SAT] == pytest.approx(PRICE_S[Work.CP_SAT] * 1.0)
    assert clock.cpu_s[Work.SPLIT_MODEL] == pytest.approx(2.3 - 0.5 - PRICE_S[Work.CP_SAT])
    fitted = work_prices.fit([clock])
    assert fitted[Work.SHAPE] == pytest.approx(1.5 / 2000)
    assert Work.CP_SAT not in fitted  # its price is the one CP-SAT's limits are set by
    assert Work.SEED not in fitted  # never charged: nothing to fit
