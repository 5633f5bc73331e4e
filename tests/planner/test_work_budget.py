"""The planner's budget counts its own work, so a loaded machine makes the same decisions.

No test here measures how long code takes: moving a clock's wall-time origin back stands for a machine
busy with other work (wall time passes, this thread's CPU time does not), moving its CPU-time origin back
or a busy loop for the planner's own work.
"""

from __future__ import annotations

import time

from planner.budget import MAX_OVERRUN_S, WALL_SAFETY, Budget, WorkClock
from planner.plan import SEARCH_FINISHED, WORK_BUDGET_STOP, plan
from tests.planner.helpers import small_problem


def _spin(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_time_other_work_takes_does_not_count_until_the_wall_clock_safety_net():
    clock = WorkClock()
    clock._wall0 -= 0.2  # 0.2 s of wall time went to someone else's work, none to this thread's
    assert clock.now() <= 0.2 / WALL_SAFETY + 0.01
    assert clock.wall_led  # and it says that the wall clock led: an answer now could depend on the load


def test_the_planners_own_work_counts():
    clock = WorkClock()
    _spin(0.05)
    assert clock.now() >= 0.05
    assert not clock.wall_led


def test_a_work_budget_expires_after_its_work_not_after_others():
    budget = Budget.of_work(0.1)
    budget.clock._wall0 -= 0.15  # wall time past the budget, none of it this thread's work
    assert not budget.expired()
    budget.clock._cpu0 -= 0.1  # as if this thread had worked 0.1 s
    assert budget.expired()


def test_the_work_clock_never_falls_more_than_the_overrun_behind_the_wall_clock():
    assert MAX_OVERRUN_S < 10.0  # the solver pool's default grace: an answer must not be killed for it
    clock = WorkClock()
    clock._wall0 -= 100.0  # as if 100 s of wall time had passed with no work done
    assert clock.now() >= 100.0 - MAX_OVERRUN_S


def test_the_solver_report_says_which_limit_ended_the_search():
    problem = small_problem(num_nodes=1, gpus_per_node=4, global_batch=8, failed=("0:1",))
    finished = plan(problem)
    # Failure-aware: the searches finished; whether the answer is proven is the bound's business.
    assert finished.solver.stopped_by == SEARCH_FINISHED
    # No time at all: the first layout found, cut short by the work budget, and the report says so.
    cut = plan(problem, Budget(time.monotonic() - 1.0))
    assert (cut.solver.status, cut.solver.stopped_by) == ("FEASIBLE", WORK_BUDGET_STOP)
    assert cut.solver.gap > 0
