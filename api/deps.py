"""FastAPI dependencies (Annotated), one place for what routes need."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.core.execution import SolverPool
from api.core.settings import Settings
from api.core.store import PlanStore


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_store(request: Request) -> PlanStore:
    return request.app.state.store


def get_pool(request: Request) -> SolverPool:
    """The solver worker pool: `await pool.run(fn, *args, deadline_s=...)` runs fn in a worker process."""
    return request.app.state.pool


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[PlanStore, Depends(get_store)]
PoolDep = Annotated[SolverPool, Depends(get_pool)]
