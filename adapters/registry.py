"""Export formats by name, shared by `resiplan export` and `GET /v1/plans/{id}/export/{format}`.

Each format is a pure function from a wire Plan to text. Formats live in
their own modules and are imported on first use, so the service does not
load a renderer it never serves.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from planner.errors import PlanningError
from wire.schemas import Plan


class ExportError(PlanningError):
    """The plan cannot be expressed in the requested format; the message says what and what to ask instead."""


@dataclass(frozen=True)
class ExportFormat:
    name: str
    media_type: str
    suffix: str
    module: str  # module defining `render(plan: Plan, replica_id: int | None) -> str`
    description: str

    def render(self, plan: Plan, replica_id: int | None = None) -> str:
        renderer: Callable[[Plan, int | None], str] = importlib.import_module(self.module).render
        return renderer(plan, replica_id)


FORMATS: tuple[ExportFormat, ...] = (
    ExportFormat("json", "application/json", ".json", "adapters.json_plan", "the plan itself"),
    ExportFormat(
        "torch-csv", "text/csv", ".csv", "adapters.torch_csv",
        "per-rank action CSV for torch.distributed.pipelining's _PipelineScheduleRuntime",
    ),
    ExportFormat("svg", "image/svg+xml", ".svg", "render.gantt_svg", "Gantt chart of a replica's schedule"),
    ExportFormat(
        "megatron", "text/x-shellscript", ".sh", "adapters.megatron", "Megatron-LM pretrain_gpt.py arguments (bash)"
    ),
    ExportFormat("deepspeed", "application/json", ".json", "adapters.deepspeed", "DeepSpeed config and PipelineModule"),
    ExportFormat("torchtitan", "text/plain", ".args", "adapters.torchtitan", "torchtitan CLI overrides"),
)


def format_names() -> tuple[str, ...]:
    return tuple(f.name for f in FORMATS)


def export_format(name: str) -> ExportFormat:
    for candidate in FORMATS:
        if candidate.name == name:
            return candidate
    raise ExportError(f"unknown export format {name!r}; choose one of: {', '.join(format_names())}")


def replica_schedule(plan: Plan, replica_id: int | None):
    """The schedule entry holding `replica_id`, or the slowest replica's when None."""
    schedule = plan.pipeline_schedule
    if schedule is None or not schedule.replicas:
        raise ExportError("this plan carries no pipeline_schedule; plan it again with this resiplan version")
    if replica_id is None:
        return max(schedule.replicas, key=lambda r: r.makespan_ms)
    for entry in schedule.replicas:
        if replica_id in entry.replica_ids:
            return entry
    known = sorted(i for entry in schedule.replicas for i in entry.replica_ids)
    raise ExportError(f"plan has no replica {replica_id}; its replicas are {known[0]}..{known[-1]}")
