"""`/v1/compare`'s answer: the user's layout against the best plan, and what each difference buys."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Discriminator, Field, RootModel, Tag

from wire.importing import ImportRequest
from wire.schemas import CompareChange, EstimateRequest, Plan


class CompareResponse(BaseModel):
    """`/v1/compare`: the user's layout (estimated, status fixed) against the best plan for the same cluster,
    model and batch, and what each difference buys alone, best first."""

    yours: Plan
    best: Plan
    speedup: float = Field(description="yours / best iteration time (>= 1 unless the planner missed the user's layout).")
    changes: list[CompareChange]
    planner_slower: bool = Field(description="True if the best plan is slower than the user's layout: a planner bug "
                                 "(the user's layout lies in the searched space), reported, never hidden.")
    not_modelled: list[str] = Field(default_factory=list)


class CompareRequest(RootModel):
    """An estimate request (a PlanRequest with the `layout` you run), or an import body (your trainer's settings,
    as `/v1/import` takes them), which is imported first."""

    root: Annotated[
        Annotated[EstimateRequest, Tag("estimate")] | Annotated[ImportRequest, Tag("import")],
        Discriminator(lambda value: _kind(value)),
    ]


def _kind(value: object) -> str:
    """A body with a `layout` is an estimate request; anything else is read as an import body."""
    if isinstance(value, dict):
        return "estimate" if "layout" in value else "import"
    return "estimate" if isinstance(value, EstimateRequest) else "import"
