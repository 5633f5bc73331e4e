"""Fit the work clock's prices (`planner.work.PRICE_S`) to the CPU time the planner's search spends.

    python -m benchmarks.work_prices            # print the fit and the table
    python -m benchmarks.work_prices --write    # also update BENCHMARKS.md

A plan's search is budgeted in counted work (`planner.budget.WorkClock`): each phase charges the units it
did (shapes costed, bounds, simulated ops, CP-SAT deterministic time, ...). This plans a set of requests
on the idle machine, each under several time limits, on a clock that also reads this thread's CPU time
at every charge and puts what passed since the last one down to the kind charged (the work just done;
work never charged lands on the next charge). A kind's fitted price is the CPU time put down to it over
its units, over all the plans. Two kinds keep their prices and are charged before the work around them,
which gets the rest of the time: CP-SAT's (`1 / DETERMINISTIC_UNITS_PER_S`, the figure its limits are set
by) and a simulated op's (about 3 us, as `planner.deadline` prices it). Per request it prints the work the committed prices count against the CPU time: where the
count falls far below it, a loaded machine lets the wall-clock safety net lead (`solver.stopped_by: wall
clock`) and the answer may depend on the load. The fitted prices are for a human to copy into
`planner/work.py`; the table is what the committed prices give.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.report import load_average, write_section
from benchmarks.solve_time import CASES, request_for
from planner.budget import WALL_SAFETY, Budget, WorkClock
from planner.plan import plan
from planner.work import PRICE_S, Work
from wire.convert import to_problem
from wire.schemas import PlanRequest

ROOT = Path(__file__).resolve().parent.parent
BODIES = [
    "api/examples/healthy-32xa100-llama2-7b.json",
    "api/examples/one-failed-256xa100-llama2-13b.json",
    "api/examples/healthy-256xa100-llama2-70b.json",
    "api/examples/mixed-256xa100-qwen2.5-32b.json",
    "api/examples/slow-64xh100-llama3-8b.json",
    "docs/example-request.json",
    "docs/slow-gpu-request.json",
    "docs/stock-request.json",
]
LIMITS_S = (0.5, 2.0, None)  # None: the request's own limit
SCALE_CASES = 3  # of `benchmarks.solve_time.CASES`: up to 4,096 GPUs (larger ones take tens of seconds each)
FIXED = (Work.CP_SAT, Work.TIMELINE_OP)  # priced by what they do alone; charged before the work around them


def _requests() -> list[tuple[str, dict]]:
    out = []
    for path in BODIES:
        body = json.loads((ROOT / path).read_text())
        for limit_s in LIMITS_S:
            label = path.rsplit("/", 1)[-1] + ("" if limit_s is None else f", {limit_s:g} s")
            options = body.get("options", {}) if limit_s is None else {**body.get("options", {}), "time_limit_s": limit_s}
            out.append((label, {**body, "options": options}))
    for label, *case, _target in CASES[:SCALE_CASES]:
        for limit_s in (1.0, 5.0):
            out.append((f"{label}, {limit_s:g} s", request_for(*case, time_limit_s=limit_s)))
    return out


class _AttributingClock(WorkClock):
    """A work clock that also puts the CPU time since the last charge down to the kind charged now."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu_s: dict[Work, float] = {}
        self._last = time.thread_time()

    def charge(self, kind: Work, units: float) -> None:
        super().charge(kind, units)
        now = time.thread_time()
        spent_s = now - self._last
        if kind in FIXED:  # its own price's worth at most; the rest is the next charge's (the model around it)
            spent_s = min(spent_s, units * PRICE_S[kind])
        self.cpu_s[kind] = self.cpu_s.get(kind, 0.0) + spent_s
        self._last += spent_s


def _measure(body: dict) -> tuple[_AttributingClock, float]:
    """The plan's clock and the CPU seconds of its search."""
    problem = to_problem(PlanRequest.model_validate(body))
    clock = _AttributingClock()
    started = time.thread_time()
    plan(problem, Budget(problem.time_limit_s, clock))
    return clock, time.thread_time() - started


def _counted_s(units: dict[Work, float]) -> float:
    return sum(PRICE_S[kind] * n for kind, n in units.items())


def fit(clocks: list[_AttributingClock]) -> dict[Work, float]:
    """Each kind's CPU time over its units, over all plans; CP-SAT's price kept."""
    out = {}
    for kind in Work:
        units = sum(clock.units.get(kind, 0.0) for clock in clocks)
        if units and kind not in FIXED:
            out[kind] = sum(clock.cpu_s.get(kind, 0.0) for clock in clocks) / units
    return out


def run() -> str:
    lines, clocks, ratios = [], [], []
    for label, body in _requests():
        clock, cpu_s = _measure(body)
        clocks.append(clock)
        counted_s = _counted_s(clock.units)
        ratios.append(counted_s / cpu_s)
        lines.append(f"| {label} | {cpu_s:.3f} | {counted_s:.3f} | {counted_s / cpu_s:.2f} |")
        print(lines[-1], flush=True)
    fitted = fit(clocks)
    prices = "\n".join(f"| {kind.value} | {PRICE_S[kind] * 1e6:,.1f} | {fitted[kind] * 1e6:,.1f} |" if kind in fitted
                       else f"| {kind.value} | {PRICE_S[kind] * 1e6:,.1f} | (kept) |" for kind in Work)
    return (
        f"{len(clocks)} plans on the idle machine ({load_average()}): each request under its own limit and "
        f"0.5 s and 2 s, and {SCALE_CASES} cases of `benchmarks.solve_time` under 1 s and 5 s. Counted: the work "
        "the committed prices (`planner/work.py`) charge; CPU: the search's thread time. Counted over CPU: "
        f"median {np.median(ratios):.2f}, least {min(ratios):.2f}, most {max(ratios):.2f}. Where it is below the "
        f"load factor over {WALL_SAFETY:g} ({2.5 / WALL_SAFETY:.2f} when the search gets 1/2.5 of a core) the "
        "wall-clock safety net leads and the answer may depend on the load; above 1, the search stops before its "
        "limit on an idle machine.\n\n"
        "| request | CPU s | counted s | counted / CPU |\n|---|---:|---:|---:|\n" + "\n".join(lines) +
        "\n\n| unit of work | price, us (committed) | CPU per unit, us (measured) |\n|---|---:|---:|\n" + prices
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    body = run()
    print(body)
    if args.write:
        write_section("Work clock prices", "python -m benchmarks.work_prices --write", body)


if __name__ == "__main__":
    main()
