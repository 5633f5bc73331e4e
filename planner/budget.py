"""The time one answer may take, as a deadline every phase of the planner shares.

A `Budget` is passed beside the problem: each phase asks how long is left,
keeps what the phases after it need (`less`, `share`), and degrades rather
than overruns when little is left. A deadline is an instant of the budget's
clock. The wall clock (`time.monotonic()`, system-wide on Linux, so a deadline
the server set holds in a solver worker process too) is where a budget starts;
`plan` runs its search on a `WorkClock`, which counts the search's work as it
is done (`charge`: shapes costed, bounds computed, layouts simulated, CP-SAT's
deterministic time; `planner.work` prices each unit in seconds of an idle core
of the benchmark machine). The same request so makes the same decisions at the
same points, and gives the same plan, however loaded the machine is. The wall
clock stays a safety net: the work clock never runs slower than a
`WALL_SAFETY`th of wall time, nor more than `MAX_OVERRUN_S` behind it, and says
when the wall clock was ahead (`wall_led`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from planner.work import PRICE_S, Work

# Wall seconds per second of work before the wall clock takes over: a machine loaded four-fold
# still plans as an idle one does; beyond, the answer keeps time rather than determinism.
WALL_SAFETY = 4.0
# Most seconds the work clock may fall behind the wall clock: the solver pool kills a task 10 s past
# its deadline by default (api.core.settings), and an answer must arrive well before that.
MAX_OVERRUN_S = 5.0
# Wall seconds the safety net lets pass before it may lead at all: work is charged in batches (512 shapes,
# a simulated schedule), so the count trails the work done by that much at times, on an idle machine too.
WALL_GRACE_S = 0.1
# Share of its planned work a search may have lost before it starts (waiting for a solver process, reading a
# large request on a busy machine) and still get all of it: beyond, the deadline is kept instead, on what is
# left, and the answer may depend on the wait (`wall_led`).
LATE_GRACE_SHARE = 0.1


class WallClock:
    """Seconds of `time.monotonic()`."""

    def now(self) -> float:
        return time.monotonic()

    def charge(self, kind: Work, units: float) -> None:
        """Work is not counted on the wall clock: it passes by itself."""


WALL_CLOCK = WallClock()


class WorkClock:
    """Seconds of work charged to it since it was made (`charge`), never less than a `WALL_SAFETY`th of
    the wall time that has passed, nor more than `MAX_OVERRUN_S` less (either less `WALL_GRACE_S`); `late_s`
    of wall time count as passed already (the time the answer lost before its search started). Mutable:
    one plan's phases share it."""

    def __init__(self, late_s: float = 0.0) -> None:
        self._wall0 = time.monotonic() - max(0.0, late_s)
        self._work_s = 0.0
        self.units: dict[Work, float] = {}  # units charged per kind of work: what the search spent its time on
        self.wall_led = False  # whether the wall clock has ever been ahead: decisions may depend on load

    def charge(self, kind: Work, units: float) -> None:
        self._work_s += units * PRICE_S[kind]
        self.units[kind] = self.units.get(kind, 0.0) + units

    def now(self) -> float:
        wall_s = time.monotonic() - self._wall0
        floor_s = max(wall_s / WALL_SAFETY, wall_s - MAX_OVERRUN_S) - WALL_GRACE_S
        if floor_s > self._work_s:
            self.wall_led = True
            return floor_s
        return self._work_s


@dataclass(frozen=True)
class Budget:
    deadline_s: float  # an instant of `clock`
    clock: WallClock | WorkClock = field(default=WALL_CLOCK, compare=False)
    # On the wall clock, the seconds of work the budget grants when they were fixed in advance (a time limit
    # less planned reserves): a late start or a loaded machine then leaves the search's work the same.
    work_s: float | None = field(default=None, compare=False)

    @classmethod
    def starting_now(cls, seconds: float) -> Budget:
        seconds = max(0.0, seconds)
        return cls(time.monotonic() + seconds, work_s=seconds)

    @classmethod
    def of_work(cls, seconds: float, late_s: float = 0.0) -> Budget:
        """`seconds` of work from now, on a fresh `WorkClock` (`late_s`: wall time lost already)."""
        clock = WorkClock(late_s)
        return cls(max(0.0, seconds), clock)

    @classmethod
    def unlimited(cls) -> Budget:
        return cls(float("inf"))

    def as_work(self) -> Budget:
        """This budget counted in work: itself when it is; else its `work_s` (or what is left of it now) on a
        fresh `WorkClock`, whose wall-clock safety net counts the wall time already past the planned start.
        A start later than `LATE_GRACE_SHARE` of the work (and `WALL_GRACE_S`) gets what is left instead."""
        if isinstance(self.clock, WorkClock):
            return self
        left_s = self.remaining_s()
        if math.isinf(left_s):
            return Budget.of_work(left_s)
        seconds = left_s if self.work_s is None else self.work_s
        late_s = seconds - left_s
        if late_s > LATE_GRACE_SHARE * seconds + WALL_GRACE_S:
            late = Budget.of_work(left_s)
            late.clock.wall_led = True
            return late
        return Budget.of_work(seconds, late_s=late_s)

    @property
    def wall_led(self) -> bool:
        """Whether the wall clock has overtaken this budget's work clock (never, on the wall clock)."""
        return isinstance(self.clock, WorkClock) and self.clock.wall_led

    def charge(self, kind: Work, units: float = 1) -> None:
        """Count `units` of work of `kind` done (`planner.work` prices them); nothing on the wall clock."""
        self.clock.charge(kind, units)

    def remaining_s(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.deadline_s - self.clock.now())

    def expired(self) -> bool:
        return self.clock.now() >= self.deadline_s

    def share(self, fraction: float) -> Budget:
        """A sub-budget ending when `fraction` (0..1) of the time left now has passed."""
        fraction = min(1.0, max(0.0, fraction))
        now = self.clock.now()
        left_s = max(0.0, self.deadline_s - now)
        work_s = None if self.work_s is None else self.work_s * fraction
        return Budget(now + left_s * fraction, self.clock, work_s)

    def less(self, reserve_s: float) -> Budget:
        """This budget, ending `reserve_s` earlier: time kept for the phases that follow."""
        reserve_s = max(0.0, reserve_s)
        work_s = None if self.work_s is None else max(0.0, self.work_s - reserve_s)
        return Budget(self.deadline_s - reserve_s, self.clock, work_s)

    def capped(self, seconds: float) -> Budget:
        """This budget, ending at most `seconds` from now."""
        seconds = max(0.0, seconds)
        work_s = None if self.work_s is None else min(self.work_s, seconds)
        return Budget(min(self.deadline_s, self.clock.now() + seconds), self.clock, work_s)
