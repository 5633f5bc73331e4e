"""The time one answer may take, as a deadline every phase of the planner shares.

A `Budget` is passed beside the problem: each phase asks how long is left,
keeps what the phases after it need (`less`, `share`), and degrades rather
than overruns when little is left. The deadline is a `time.monotonic()`
instant; that clock is system-wide on Linux, so a deadline the server set
holds in a solver worker process too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    deadline_s: float  # a time.monotonic() instant

    @classmethod
    def starting_now(cls, seconds: float) -> Budget:
        return cls(time.monotonic() + max(0.0, seconds))

    @classmethod
    def unlimited(cls) -> Budget:
        return cls(float("inf"))

    def remaining_s(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.deadline_s - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline_s

    def share(self, fraction: float) -> Budget:
        """A sub-budget ending when `fraction` (0..1) of the time left now has passed."""
        now = time.monotonic()
        left_s = max(0.0, self.deadline_s - now)
        return Budget(now + left_s * min(1.0, max(0.0, fraction)))

    def less(self, reserve_s: float) -> Budget:
        """This budget, ending `reserve_s` earlier: time kept for the phases that follow."""
        return Budget(self.deadline_s - max(0.0, reserve_s))

    def capped(self, seconds: float) -> Budget:
        """This budget, ending at most `seconds` from now."""
        return Budget(min(self.deadline_s, time.monotonic() + max(0.0, seconds)))
