"""The time one answer may take, as a deadline every phase of the planner shares.

A `Budget` is passed beside the problem: each phase asks how long is left,
keeps what the phases after it need (`less`, `share`), and degrades rather
than overruns when little is left. A deadline is an instant of the budget's
clock. The wall clock (`time.monotonic()`, system-wide on Linux, so a deadline
the server set holds in a solver worker process too) is the default; `plan`
runs its search on a `WorkClock`, which counts the CPU time the search itself
has spent, so that a loaded machine (where wall time passes two or three times
faster than the planner's work) makes the same decisions at the same points,
and so the same plan. The wall clock stays a safety net: the work clock never
runs slower than a `WALL_SAFETY`th of wall time, nor more than `MAX_OVERRUN_S`
behind it, and says when the wall clock was ahead (`wall_led`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Wall seconds per second of work before the wall clock takes over: a machine loaded four-fold
# still plans as an idle one does; beyond, the answer keeps time rather than determinism.
WALL_SAFETY = 4.0
# Most seconds the work clock may fall behind the wall clock: the solver pool kills a task 10 s past
# its deadline by default (api.core.settings), and an answer must arrive well before that.
MAX_OVERRUN_S = 5.0


class WallClock:
    """Seconds of `time.monotonic()`."""

    def now(self) -> float:
        return time.monotonic()


WALL_CLOCK = WallClock()


class WorkClock:
    """Seconds of CPU time this thread has spent since the clock was made (CP-SAT, solving with one
    worker, runs on the calling thread and counts too), never less than a `WALL_SAFETY`th of the wall
    time that has passed, nor more than `MAX_OVERRUN_S` less. Mutable: one plan's phases share it."""

    def __init__(self) -> None:
        self._cpu0 = time.thread_time()
        self._wall0 = time.monotonic()
        self.wall_led = False  # whether the wall clock has ever been ahead: decisions may depend on load

    def now(self) -> float:
        work_s = time.thread_time() - self._cpu0
        wall_s = time.monotonic() - self._wall0
        floor_s = max(wall_s / WALL_SAFETY, wall_s - MAX_OVERRUN_S)
        if floor_s > work_s:
            self.wall_led = True
            return floor_s
        return work_s


@dataclass(frozen=True)
class Budget:
    deadline_s: float  # an instant of `clock`
    clock: WallClock | WorkClock = field(default=WALL_CLOCK, compare=False)

    @classmethod
    def starting_now(cls, seconds: float) -> Budget:
        return cls(time.monotonic() + max(0.0, seconds))

    @classmethod
    def of_work(cls, seconds: float) -> Budget:
        """`seconds` of work from now, on a fresh `WorkClock`."""
        clock = WorkClock()
        return cls(clock.now() + max(0.0, seconds), clock)

    @classmethod
    def unlimited(cls) -> Budget:
        return cls(float("inf"))

    @property
    def wall_led(self) -> bool:
        """Whether the wall clock has overtaken this budget's work clock (never, on the wall clock)."""
        return isinstance(self.clock, WorkClock) and self.clock.wall_led

    def remaining_s(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.deadline_s - self.clock.now())

    def expired(self) -> bool:
        return self.clock.now() >= self.deadline_s

    def share(self, fraction: float) -> Budget:
        """A sub-budget ending when `fraction` (0..1) of the time left now has passed."""
        now = self.clock.now()
        left_s = max(0.0, self.deadline_s - now)
        return Budget(now + left_s * min(1.0, max(0.0, fraction)), self.clock)

    def less(self, reserve_s: float) -> Budget:
        """This budget, ending `reserve_s` earlier: time kept for the phases that follow."""
        return Budget(self.deadline_s - max(0.0, reserve_s), self.clock)

    def capped(self, seconds: float) -> Budget:
        """This budget, ending at most `seconds` from now."""
        return Budget(min(self.deadline_s, self.clock.now() + max(0.0, seconds)), self.clock)
