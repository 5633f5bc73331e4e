"""The FastAPI application factory."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from api.routes import detect, plans, replan, ui
from api.settings import Settings
from api.store import PlanStore, make_engine
from planner.errors import PlanningError


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.settings = settings
        app.state.store = PlanStore(make_engine(settings.database_url))
        try:
            yield
        finally:
            app.state.store.close()

    app = FastAPI(
        title="resiplan",
        version="0.1.0",
        summary="Failure-aware data/tensor/pipeline-parallel layout planning for large-model training.",
        lifespan=lifespan,
    )

    @app.exception_handler(PlanningError)
    async def planning_error(_request: Request, error: PlanningError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": str(error)})

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.include_router(plans.router)
    app.include_router(replan.router)
    app.include_router(detect.router)
    app.include_router(ui.router)
    return app
