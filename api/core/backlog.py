"""How long the solver pool needs to make room: the `Retry-After` a rejected request is told.

    wait ~ sum of the typical run time of every admitted task (running or queued) / workers

A task's typical run time is the mean of the last `WINDOW` run times of its kind (the task function:
plans, estimates and detects differ by 10x or more, and a plan's depends on the cluster sizes being
sent). A kind not seen yet counts as the mean of every recent run of any kind, and before any task has
run, as `FIRST_GUESS_S`. The answer is whole seconds (what the header carries), at least 1 and at most
the caller's cap, so a client that waits that long finds the backlog it was turned away for gone.

Running tasks count whole, not by what is left of them: the pool does not know how far a solve has got,
and over-estimating by a task costs a waiting client less than a second 503.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

WINDOW = 16
FIRST_GUESS_S = 1.0


class RunTimes:
    """Recent run times per task kind. Owned by one pool and used from its event loop."""

    def __init__(self, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._window = window
        self._recent: dict[str, deque[float]] = {}

    def record(self, kind: str, seconds: float) -> None:
        self._recent.setdefault(kind, deque(maxlen=self._window)).append(max(0.0, seconds))

    def typical_s(self, kind: str) -> float:
        """Mean of `kind`'s recent run times; of every kind's when it has none; FIRST_GUESS_S before any."""
        recent = self._recent.get(kind)
        if recent:
            return sum(recent) / len(recent)
        every = [seconds for runs in self._recent.values() for seconds in runs]
        return sum(every) / len(every) if every else FIRST_GUESS_S


def drain_s(backlog: Mapping[str, int], workers: int, run_times: RunTimes) -> float:
    """Seconds until `workers` processes have worked through `backlog` (tasks admitted, by kind)."""
    return sum(count * run_times.typical_s(kind) for kind, count in backlog.items()) / max(1, workers)


def retry_after_s(backlog: Mapping[str, int], workers: int, run_times: RunTimes, max_s: int) -> int:
    """drain_s in whole seconds, rounded up, within [1, max_s]."""
    return max(1, min(max_s, math.ceil(drain_s(backlog, workers, run_times))))
