"""Per-op compute timers and the injected slowdown (`--slow-rank`, `--slow-factor`)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable


def _sleep_until(deadline: float) -> None:
    """Sleep, then spin the last 2 ms: a plain sleep on a busy host wakes up late, inflating the slowdown."""
    while (left := deadline - time.perf_counter()) > 0.002:
        time.sleep(left - 0.002)
    while time.perf_counter() < deadline:
        pass


class OpTimer:
    """Per-microbatch compute time of one rank; optionally slowed by sleeping (factor - 1) x each op."""

    def __init__(self, slow_factor: float = 1.0):
        self.slow_factor = slow_factor
        self.ms: dict[int, float] = defaultdict(float)

    def record(self, microbatch: int, start: float) -> None:
        if self.slow_factor > 1.0:
            _sleep_until(start + self.slow_factor * (time.perf_counter() - start))
        self.ms[microbatch] += (time.perf_counter() - start) * 1000.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(microbatch: int, *args, **kwargs):
            start = time.perf_counter()
            result = fn(microbatch, *args, **kwargs)
            self.record(microbatch, start)
            return result

        return timed

    def take(self) -> dict[int, float]:
        ms, self.ms = dict(self.ms), defaultdict(float)
        return ms


