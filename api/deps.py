"""FastAPI dependencies (Annotated), one place for what routes need."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.settings import Settings
from api.store import PlanStore


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_store(request: Request) -> PlanStore:
    return request.app.state.store


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[PlanStore, Depends(get_store)]
