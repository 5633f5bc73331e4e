"""Injected slowdowns and the op timer, without processes."""

from __future__ import annotations

import time

import pytest

from executor.timing import OpTimer, Slowdown, slow_factor


def test_slowdown_parses_device_factor_and_step():
    assert Slowdown.parse("3:0:2.5@10") == Slowdown("3:0", 2.5, 10)
    assert Slowdown.parse("0:1:4") == Slowdown("0:1", 4.0, 0)


@pytest.mark.parametrize("text", ["3:0", "3:2.5@1", "a:0:2", "3:0:0.5", "3:0:2@x", "3:0:1000"])
def test_bad_slowdowns_are_refused(text):
    with pytest.raises(ValueError, match="--slow-device"):
        Slowdown.parse(text)


def test_a_slowdown_starts_at_its_step_and_the_latest_wins():
    slowdowns = (Slowdown("1:0", 2.0, 5), Slowdown("1:0", 3.0, 8), Slowdown("0:0", 4.0, 0))
    assert [slow_factor(slowdowns, "1:0", step) for step in (0, 4, 5, 7, 8, 20)] == [1, 1, 2, 2, 3, 3]
    assert slow_factor(slowdowns, "0:1", 9) == 1.0


def test_waiting_is_not_compute():
    """A sleeping op (a wait, as in a collective) reports next to nothing; a computing one reports its work."""
    timer = OpTimer()
    start = timer.start()
    time.sleep(0.2)
    timer.record(0, start)
    start = timer.start()
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:
        pass
    timer.record(1, start)
    ms = timer.take()
    assert ms[0] < 20 and ms[1] >= 50
    assert timer.take() == {}


def test_emulated_ops_last_their_work_times_the_slowdown():
    timer = OpTimer(slow_factor=2.0, emulate_ms_per_layer=10.0)
    start = timer.start()
    timer.record(3, start, work_layers=1.5)  # 1.5 layer-microbatches x 10 ms x 2
    assert timer.take() == {3: pytest.approx(30.0)}
