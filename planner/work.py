"""What each unit of the planner's search work costs, in seconds, for the work clock to count.

A plan's search is budgeted in work, not wall time (`planner.budget.WorkClock`), so the same request
makes the same decisions on an idle machine and on a loaded one. Each phase charges its budget as it
goes (`Budget.charge(kind, units)`), and each kind of unit is priced here in seconds of one idle core
of the 2-core benchmark machine: fitted (`python -m benchmarks.work_prices`) so that the work counted
over the benchmark requests tracks the CPU time the search spends. A price that is off moves where a
search is cut, never whether the answer repeats; work no phase charges (building the plan, the wire
form) is kept out of the search's time by `planner.deadline`'s reserves.
"""

from __future__ import annotations

from enum import Enum
from types import MappingProxyType

# CP-SAT's deterministic time per second of one idle core of the benchmark machine, so a limit of s seconds
# does about s seconds of work. Measured on the schedule model (`planner.schedules.optimal`, 1,024 H100s,
# llama3-70b): 1.385 units in 1.31-1.38 s of CPU time (`python -m benchmarks.work_prices`).
DETERMINISTIC_UNITS_PER_S = 1.0


class Work(Enum):
    SHAPE = "uniform shape costed and bounded"
    STOCK_FLOOR = "stock shape's simulation floor"
    STOCK_UNIT = "stock split or placement bounded"
    TIMELINE_OP = "timeline op simulated"
    SEED = "uniform shape's even split evaluated"
    SPLIT_MODEL = "layer-split model built"
    CP_SAT = "CP-SAT deterministic time unit"
    OUTER_CHOICE = "non-uniform outer choice bounded"
    STRONG_BOUND = "non-uniform strong bound computed"
    TEMPLATE = "non-uniform template built"
    ALLOCATION_STEP = "allocation refined or settled, per template it chooses among"
    SCHEDULE_OP = "op of a schedule search (list schedules, CP-SAT model)"
    SMALL_SOLVE = "small CP-SAT model solved (an allocation probe)"


# Seconds per unit; CP-SAT's own deterministic time is converted as `planner.cp_sat` limits it.
PRICE_S = MappingProxyType({
    Work.SHAPE: 20e-6,
    Work.STOCK_FLOOR: 9e-6,
    Work.STOCK_UNIT: 200e-6,
    Work.TIMELINE_OP: 3e-6,
    Work.SEED: 280e-6,
    Work.SPLIT_MODEL: 8e-3,
    Work.CP_SAT: 1.0 / DETERMINISTIC_UNITS_PER_S,
    Work.OUTER_CHOICE: 9e-6,
    Work.STRONG_BOUND: 230e-6,
    Work.TEMPLATE: 120e-6,
    Work.ALLOCATION_STEP: 100e-6,
    Work.SCHEDULE_OP: 40e-6,
    Work.SMALL_SOLVE: 1e-3,
})
