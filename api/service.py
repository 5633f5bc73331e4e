"""Request -> plan, shared by the HTTP routes and the command line."""

from __future__ import annotations

import uuid
from dataclasses import replace

from api.convert import to_problem, to_wire
from api.schemas import EstimateRequest, Plan, PlanRequest
from planner.estimate import FixedLayout, estimate_layout
from planner.plan import plan


def new_plan_id() -> str:
    return uuid.uuid4().hex


def plan_for(request: PlanRequest, max_time_limit_s: float | None = None) -> Plan:
    problem = to_problem(request)
    if max_time_limit_s is not None and problem.time_limit_s > max_time_limit_s:
        problem = replace(problem, time_limit_s=max_time_limit_s)
    return to_wire(plan(problem), new_plan_id())


def estimate_for(request: EstimateRequest) -> Plan:
    layout = request.layout
    fixed = FixedLayout(
        tp=layout.tp,
        pp=layout.pp,
        micro_batch_size=layout.micro_batch_size,
        virtual_stages=layout.virtual_stages,
        schedule=layout.schedule,
        recompute=layout.recompute,
        layers_per_stage=tuple(layout.layers_per_stage) if layout.layers_per_stage is not None else None,
        dp=layout.dp,
    )
    return to_wire(estimate_layout(to_problem(request), fixed), new_plan_id())
