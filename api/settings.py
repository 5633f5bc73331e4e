"""Service settings from the environment (prefix RESIPLAN_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """database_url: SQLAlchemy URL of the plan store; the default is an embedded SQLite
    file in the working directory. max_time_limit_s: cap on a request's options.time_limit_s.
    """

    model_config = SettingsConfigDict(env_prefix="RESIPLAN_")

    database_url: str = Field(default="sqlite:///resiplan.db")
    max_time_limit_s: float = Field(default=60.0, gt=0)
