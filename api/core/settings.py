"""Service settings from the environment (prefix RESIPLAN_)."""

from __future__ import annotations

import os

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

MIB = 1024 * 1024
MAX_VIEW_LINK_TTL_S = 7 * 24 * 3600


class Settings(BaseSettings):
    """database_url: SQLAlchemy URL of the plan store; the default is an embedded SQLite
    file in the working directory. max_time_limit_s: cap on a request's options.time_limit_s.

    api_token: when set (and not empty), every /v1 route requires `Authorization: Bearer <token>`.
    solver_workers: solver processes; None: one per CPU. solver_queue_size: requests that may wait
    for a worker beyond those solving; None: as many as there are workers; past that, 503.
    solver_grace_s: seconds past a request's deadline before its worker is killed (504).
    solver_worker_max_rss_mib: a solver worker resident in more memory than this after a task (the
    allocator keeps much of what a large parse or solve freed) exits once its answer is sent and is
    replaced by a fresh one. A fresh worker is ~80 MiB; after a 65,536-GPU solve it holds ~170 MiB, after
    a 60 MiB /v1/detect ~100 MiB.
    max_body_bytes / max_detect_body_bytes: request body limits (413), the second for /v1/detect.
    max_json_depth: nesting limit of a JSON body (422). log_level: of the JSON log lines on stderr.
    body_timeout_s: seconds a client has to send a whole request body once it started (408 after), so a
    slow sender cannot hold a connection forever. render_time_limit_s: deadline of rendering a stored plan
    (exports, SVG, plan page; in the solver pool). view_link_ttl_s: default lifetime of a signed view link
    (POST /v1/plans/{id}/view-link) when auth is on. plan_cache_mib: recently served plan JSON kept in
    memory by GET /v1/plans/{id} (plans never change once stored, so a copy cannot go stale).
    """

    model_config = SettingsConfigDict(env_prefix="RESIPLAN_")

    database_url: str = Field(default="sqlite:///resiplan.db")
    max_time_limit_s: float = Field(default=60.0, gt=0)
    api_token: SecretStr | None = Field(default=None)
    solver_workers: int | None = Field(default=None, ge=1, le=1024)
    solver_queue_size: int | None = Field(default=None, ge=0, le=100_000)
    # The planner answers at its time limit, plus assembly: seconds for the largest clusters.
    solver_grace_s: float = Field(default=10.0, ge=0)
    solver_worker_max_rss_mib: float = Field(default=512.0, gt=0)
    # A plan request with every GPU of the largest cluster listed as failed is ~1.5 MB.
    max_body_bytes: int = Field(default=2 * MIB, ge=1024)
    # 4,096 devices x 8 iterations of 8 packed microbatches each is ~24 MB of telemetry.
    max_detect_body_bytes: int = Field(default=64 * MIB, ge=1024)
    max_json_depth: int = Field(default=32, ge=4, le=1000)
    log_level: str = Field(default="info", pattern=r"(?i)^(debug|info|warning|error|critical)$")
    # A 2 MiB body over a 1 Mbit/s link takes ~17 s.
    body_timeout_s: float = Field(default=30.0, gt=0)
    # The largest plans the limits admit render in seconds; the pool's grace period comes on top.
    render_time_limit_s: float = Field(default=30.0, gt=0)
    view_link_ttl_s: int = Field(default=900, ge=10, le=MAX_VIEW_LINK_TTL_S)
    # A few of the largest plans (30+ MB each); plans a job's nodes fetch together after a replan.
    plan_cache_mib: int = Field(default=256, ge=0, le=1 << 20)

    def workers(self) -> int:
        return self.solver_workers or os.cpu_count() or 1

    def queue_size(self) -> int:
        return self.workers() if self.solver_queue_size is None else self.solver_queue_size

    def token(self) -> str | None:
        """The API token, or None when auth is off (unset or empty)."""
        return self.api_token.get_secret_value() if self.api_token and self.api_token.get_secret_value() else None

    def time_limit_s(self, requested_s: float) -> float:
        """A request's solver budget: what it asked for, at most max_time_limit_s."""
        return min(requested_s, self.max_time_limit_s)
