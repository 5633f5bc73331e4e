"""The load benchmark's machinery on a small run: a real server subprocess, a pool too small for the
requests (so some are refused with 503 and retried), and its exactly-once checks."""

from __future__ import annotations

from benchmarks.load import check, report, run


def test_a_small_overloaded_run_answers_every_request_exactly_once():
    result = run(requests=6, workers=1, queue_size=1, time_limit_s=0.5, max_attempts=100,
                 probe_interval_s=0.05, timeout_s=300)
    assert check(result) == []
    assert all(outcome.statuses.count(200) == 1 for outcome in result.outcomes)
    assert sum(outcome.rejected for outcome in result.outcomes) > 0, "the pool was never full; nothing was shown"
    assert result.stored_plans == 6
    assert result.probes and all(probe.latency_s is not None for probe in result.probes)
    assert "| plan requests answered 200 / sent | 6 / 6 |" in report(result, 6, 0.5)
