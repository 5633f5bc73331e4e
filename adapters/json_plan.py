"""The plan itself, as the service returns it."""

from __future__ import annotations

from api.schemas import Plan


def render(plan: Plan, replica_id: int | None = None) -> str:
    return plan.model_dump_json(indent=2) + "\n"
