"""A stored plan turned into an export, an SVG or the plan page, in a solver worker.

Rendering a plan of 100,000 GPUs takes seconds of CPU; in the server it would stall every other client
(health checks included), so the routes run these through the solver pool, with its admission control
and deadlines. They take the plan as the JSON text the store holds and parse it here.
"""

from __future__ import annotations

from collections.abc import Mapping

from adapters.registry import export_format
from adapters.stock import check_replica
from wire.schemas import Plan


def render_export(format_name: str, plan_json: str, replica_id: int | None) -> str:
    plan = Plan.model_validate_json(plan_json)
    check_replica(plan, replica_id)  # every format, the plan itself too, refuses a replica the plan lacks
    return export_format(format_name).render(plan, replica_id)


def render_plan_page(plan_json: str, replica_id: int | None, link_query: Mapping[str, str] | None) -> str:
    from render.plan_page import plan_page_html

    plan = Plan.model_validate_json(plan_json)
    check_replica(plan, replica_id)
    slow_speeds = {slow.device: slow.speed for slow in plan.slow_devices}
    return plan_page_html(plan, replica_id, slow_speeds, link_query=link_query)
