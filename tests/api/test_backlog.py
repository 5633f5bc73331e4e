"""Retry-After arithmetic (api.core.backlog): recent run times per task kind, and the backlog they drain at."""

from __future__ import annotations

import pytest

from api.core.backlog import FIRST_GUESS_S, WINDOW, RunTimes, drain_s, retry_after_s


def test_a_kinds_typical_run_time_is_the_mean_of_its_recent_runs():
    times = RunTimes(window=3)
    for seconds in (100.0, 2.0, 4.0, 6.0):  # the 100 s run has left the window
        times.record("plan_answer", seconds)
    assert times.typical_s("plan_answer") == pytest.approx(4.0)
    times.record("detect_json", 1.0)
    assert times.typical_s("detect_json") == pytest.approx(1.0)
    assert times.typical_s("plan_answer") == pytest.approx(4.0)  # kinds do not mix


def test_an_unseen_kind_counts_as_every_recent_run_and_nothing_seen_as_the_first_guess():
    times = RunTimes()
    assert times.typical_s("plan_answer") == FIRST_GUESS_S
    times.record("plan_answer", 9.0)
    times.record("detect_json", 3.0)
    assert times.typical_s("estimate_answer") == pytest.approx(6.0)


def test_the_default_window_keeps_the_last_runs_only():
    times = RunTimes()
    for _ in range(WINDOW):
        times.record("plan_answer", 20.0)
    times.record("plan_answer", 20.0 + WINDOW)  # pushes one 20 s run out
    assert times.typical_s("plan_answer") == pytest.approx(20.0 + 1.0)


def test_the_wait_grows_with_the_backlog_and_with_recent_run_times():
    times = RunTimes()
    times.record("plan_answer", 15.0)
    times.record("detect_json", 3.0)
    backlog = {"plan_answer": 2, "detect_json": 2}
    assert drain_s(backlog, workers=2, run_times=times) == pytest.approx((2 * 15 + 2 * 3) / 2)
    waits = [retry_after_s({"plan_answer": depth}, 2, times, max_s=600) for depth in range(1, 6)]
    assert waits == [8, 15, 23, 30, 38]  # ceil(depth x 15 / 2)
    times.record("plan_answer", 25.0)  # slower solves lately: mean 20 s
    assert retry_after_s({"plan_answer": 3}, 2, times, max_s=600) == 30


def test_the_wait_is_whole_seconds_within_one_and_the_cap():
    times = RunTimes()
    times.record("echo", 0.01)
    assert retry_after_s({}, 4, times, max_s=60) == 1
    assert retry_after_s({"echo": 3}, 4, times, max_s=60) == 1
    times.record("plan_answer", 50.0)
    assert retry_after_s({"plan_answer": 10}, 2, times, max_s=60) == 60
    assert isinstance(retry_after_s({"plan_answer": 1}, 3, times, max_s=60), int)
    assert retry_after_s({"plan_answer": 1}, 3, times, max_s=60) == 17  # 50 / 3 = 16.7, rounded up


def test_run_times_refuse_an_empty_window_and_clamp_negative_durations():
    with pytest.raises(ValueError):
        RunTimes(window=0)
    times = RunTimes()
    times.record("echo", -1.0)  # a clock step backwards is not a negative run
    assert times.typical_s("echo") == 0.0
