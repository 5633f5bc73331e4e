"""How long an answer takes at the least, and how much of its deadline each phase leaves to the next.

`options.time_limit_s` counts from the request's arrival to its answer. Some of
that goes to work whose cost does not depend on the search: a plan lists every
GPU of the cluster (in a stage, unused or excluded) and every slow one, so
reading the request, setting up the search, assembling the plan, simulating one
timeline per distinct replica, writing the wire form and its JSON, storing and
sending it cost time in proportion to the GPUs, the failed or slow devices and
the timeline ops. The figures below are that work measured on the 2-core
benchmark machine (`python -m benchmarks.deadlines`), with room for its load.
The layout search gets what is left; an answer keeps its limit when the limit
is at least `least_time_limit_s`, and a smaller limit is raised to that, the
answer saying so (`api.tasks.planning.plan_for`).
"""

from __future__ import annotations

from planner.problem import PlanningProblem
from planner.uniform.candidates import uniform_shape_count

# Seconds, plus seconds per GPU of the cluster and per failed or slow device it holds, of what an
# answer spends whatever its search does: reading and validating the request (before the server's
# deadline starts) and handing it to a solver process, where a slow device is a pydantic object
# (pickling and unpickling 50,000 took 0.42 s) and a failed one a string; the planner's setup
# before its first search step (the problem, slot inventories per TP size, the first incumbents),
# plus every uniform shape costed; after the search, assembling the plan and its first-choice
# timelines; after the planner, the wire form and its validation, JSON, the trip back to the server,
# the store and the send.
READ_S, READ_S_PER_SLOW_DEVICE = 0.0, 5e-6
TRANSFER_S, TRANSFER_S_PER_SLOW_DEVICE = 0.01, 10e-6
# Per uniform shape: 17-18 us measured (`ranked_candidates` over 53,564-93,286 shapes of llama3-405b at
# 4,096-65,536 GPUs, now that every micro-batch size dividing the batch is a shape; it was 8 us), plus
# 4-6 us for the stock search's simulation floor of each (its queue is built even when it has no time).
SETUP_S, SETUP_S_PER_GPU, SETUP_S_PER_DAMAGED_DEVICE, SETUP_S_PER_SHAPE = 0.03, 0.5e-6, 4e-6, 23e-6
FINISH_S, FINISH_S_PER_GPU, FINISH_S_PER_DAMAGED_DEVICE = 0.03, 1.8e-6, 3e-6
WIRE_S, WIRE_S_PER_GPU, WIRE_S_PER_DAMAGED_DEVICE = 0.05, 1.8e-6, 3e-6
# Simulating one op of a timeline (~3 us) and carrying it to the client (wire model, JSON, store,
# send: ~1.5 us), with room for the machine's load; the share of that spent after the planner returns.
SECONDS_PER_TIMELINE_OP = 6e-6
TIMELINE_WIRE_SHARE = 0.35


def ops_cost_s(ops: int) -> float:
    """What simulating timelines of `ops` ops in all and sending them costs, about."""
    return SECONDS_PER_TIMELINE_OP * ops


def damaged_devices(problem: PlanningProblem) -> int:
    cluster = problem.cluster
    return len(cluster.failed) + len(cluster.slow)


def _per_device_s(problem: PlanningProblem, per_gpu_s: float, per_damaged_s: float) -> float:
    return per_gpu_s * problem.cluster.total_devices + per_damaged_s * damaged_devices(problem)


def reading_s(problem: PlanningProblem) -> float:
    """What reading and validating the request took before the planner was called, about: the
    deadline counts from the request's arrival."""
    return READ_S + READ_S_PER_SLOW_DEVICE * len(problem.cluster.slow)


def transfer_s(problem: PlanningProblem) -> float:
    """What handing the request to a solver process takes, about."""
    return TRANSFER_S + TRANSFER_S_PER_SLOW_DEVICE * len(problem.cluster.slow)


def setup_s(problem: PlanningProblem) -> float:
    """What the planner spends before its first search step, about."""
    return SETUP_S + _per_device_s(problem, SETUP_S_PER_GPU, SETUP_S_PER_DAMAGED_DEVICE) + (
        SETUP_S_PER_SHAPE * uniform_shape_count(problem))


def finish_reserve_s(problem: PlanningProblem) -> float:
    """Of the planner's deadline, what the layout search leaves for assembling the plan and its timelines."""
    return FINISH_S + _per_device_s(problem, FINISH_S_PER_GPU, FINISH_S_PER_DAMAGED_DEVICE)


def wire_reserve_s(problem: PlanningProblem) -> float:
    """Of the answer's deadline, what the planner leaves for its wire form, JSON, store and send."""
    return WIRE_S + _per_device_s(problem, WIRE_S_PER_GPU, WIRE_S_PER_DAMAGED_DEVICE)


def least_time_limit_s(problem: PlanningProblem) -> float:
    """The least `time_limit_s` this problem's answer can keep (see the module docstring)."""
    return (reading_s(problem) + transfer_s(problem) + setup_s(problem) + finish_reserve_s(problem)
            + wire_reserve_s(problem))


def raised_limit_note(problem: PlanningProblem, limit_s: float, least_s: float) -> str:
    cluster = problem.cluster
    return (
        f"time_limit_s {limit_s:.3g} is below the {least_s:.3g} s an answer for {cluster.total_devices:,} GPUs "
        f"with {damaged_devices(problem):,} failed or slow devices takes at the least: raised to {least_s:.3g} s"
    )


def late_start_note(left_s: float, least_s: float) -> str:
    return (
        f"only {max(0.0, left_s):.3g} s of time_limit_s were left when the planner started (after waiting for a "
        f"solver process and being handed to it); the answer takes at least {least_s:.3g} s from then"
    )
