"""`/v1/compare`'s answer: the user's layout against the best plan, and what each difference buys."""

from __future__ import annotations

from pydantic import BaseModel, Field

from wire.schemas import Plan


class CompareChange(BaseModel):
    """One difference between the user's layout and the best plan, applied alone to the user's layout."""

    change: str = Field(description='What changes, e.g. "micro_batch_size 1 → 4".')
    iteration_time_s: float | None = Field(description="The user's layout with only this change; null when it "
                                           "cannot run (`why` says why).")
    gain: float | None = Field(description="Share of the user's iteration time this change alone saves (negative: it "
                               "costs); null when it cannot run.")
    why: str | None = None


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
