"""Plans for the benchmark tables: a request planned in this process, or None where no layout fits."""

from __future__ import annotations

from api.tasks.planning import plan_for
from planner.errors import PlanningError
from wire.schemas import Plan, PlanRequest


def plan_or_none(body: dict) -> Plan | None:
    """The plan of `body`, or None when the planner finds no layout that fits (the table says so)."""
    try:
        return plan_for(PlanRequest.model_validate(body))
    except PlanningError:
        return None
