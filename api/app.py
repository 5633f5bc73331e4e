"""The FastAPI application factory."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from api.auth import BearerTokenMiddleware
from api.execution import PoolConfig, PoolError, SolverPool
from api.limits import BodyLimitMiddleware, BodyLimits
from api.logs import configure_logging
from api.metrics import CONTENT_TYPE, Metrics
from api.observe import ObserveMiddleware
from api.routes import detect, plans, replan, ui
from api.service import BodyValidationError
from api.settings import Settings
from api.store import PlanStore, make_engine
from planner.errors import PlanningError


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    configure_logging(settings.log_level)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.settings = settings
        app.state.store = PlanStore(make_engine(settings.database_url))
        pool = SolverPool(
            PoolConfig(workers=settings.workers(), queue_size=settings.queue_size(), grace_s=settings.solver_grace_s),
            observer=app.state.metrics,
        )
        await pool.start()
        app.state.pool = pool
        try:
            yield
        finally:
            del app.state.pool
            await pool.close()
            app.state.store.close()

    app = FastAPI(
        title="resiplan",
        version="0.1.0",
        summary="Failure-aware data/tensor/pipeline-parallel layout planning for large-model training.",
        lifespan=lifespan,
    )
    app.state.metrics = Metrics(pool_stats=lambda: pool.stats() if (pool := getattr(app.state, "pool", None)) else None)

    # Added innermost first: requests pass ObserveMiddleware, then the token check, then the body limits.
    app.add_middleware(
        BodyLimitMiddleware,
        limits=BodyLimits(
            max_bytes=settings.max_body_bytes,
            max_json_depth=settings.max_json_depth,
            max_bytes_by_path={detect.DETECT_PATH: settings.max_detect_body_bytes},
            depth_unchecked_paths=frozenset({detect.DETECT_PATH}),
        ),
    )
    app.add_middleware(BearerTokenMiddleware, token=settings.token())
    app.add_middleware(ObserveMiddleware, metrics=app.state.metrics)

    @app.exception_handler(PlanningError)
    async def planning_error(_request: Request, error: PlanningError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": str(error)})

    @app.exception_handler(PoolError)
    async def pool_error(_request: Request, error: PoolError) -> JSONResponse:
        headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
        return JSONResponse(status_code=error.status_code, content={"detail": str(error)}, headers=headers)

    @app.exception_handler(BodyValidationError)
    async def body_validation_error(_request: Request, error: BodyValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": error.errors})

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """Prometheus text format."""
        return Response(content=app.state.metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(plans.router)
    app.include_router(replan.router)
    app.include_router(detect.router)
    app.include_router(ui.router)
    detect.document_request_body(app)
    return app
