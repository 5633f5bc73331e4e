"""The FastAPI application factory."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.concurrency import run_in_threadpool

from api.core.auth import BearerTokenMiddleware
from api.core.body import document_bodies
from api.core.execution import PoolConfig, PoolError, SolverPool
from api.core.limits import BodyLimitMiddleware, BodyLimits
from api.core.logs import configure_logging
from api.core.metrics import CONTENT_TYPE, Metrics
from api.core.observe import ObserveMiddleware
from api.core.settings import Settings
from api.core.store import PlanStore, StoreUnavailable, make_engine
from api.routes import calibrations, detect, gpus, imports, plans, replan, ui
from planner.errors import PlanningError
from wire.errors import RequestBodyInvalid, error_body, field_errors, validation_detail
from wire.comparison import CompareRequest
from wire.importing import ImportRequest
from wire.schemas import ErrorDetail, EstimateRequest, PlanRequest, ReplanRequest

# Seconds a client is told to wait when the plan store is down: a restart of a database server.
STORE_RETRY_AFTER_S = 5


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    configure_logging(settings.log_level)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.settings = settings
        app.state.store = PlanStore(make_engine(settings.database_url), cache_bytes=settings.plan_cache_mib * 1024 * 1024)
        pool = SolverPool(
            PoolConfig(workers=settings.workers(), queue_size=settings.queue_size(), grace_s=settings.solver_grace_s,
                       max_worker_rss_mib=settings.solver_worker_max_rss_mib),
            observer=app.state.metrics,
        )
        try:
            await pool.start()
        except BaseException:
            # The service does not start: nothing else closes them (close stops workers still starting).
            await pool.close()
            app.state.store.close()
            raise
        app.state.pool = pool
        try:
            yield
        finally:
            del app.state.pool
            await pool.close()
            app.state.store.close()

    # /docs and /redoc load Swagger UI and ReDoc from the fastapi-offline package, not from a CDN: GPU
    # clusters are often offline.
    app = FastAPIOffline(
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
            body_timeout_s=settings.body_timeout_s,
        ),
    )
    app.add_middleware(BearerTokenMiddleware, token=settings.token())
    app.add_middleware(ObserveMiddleware, metrics=app.state.metrics)

    @app.exception_handler(PlanningError)
    async def planning_error(_request: Request, error: PlanningError) -> JSONResponse:
        return JSONResponse(status_code=422, content=error_body(str(error)))

    @app.exception_handler(RequestBodyInvalid)
    async def body_invalid(_request: Request, error: RequestBodyInvalid) -> JSONResponse:
        return JSONResponse(status_code=422, content=error_body(error.detail, error.errors))

    @app.exception_handler(RequestValidationError)
    async def parameter_error(_request: Request, error: RequestValidationError) -> JSONResponse:
        # Query and path parameters (bodies go through api.core.body); never echoes the input.
        errors = field_errors(error.errors())
        return JSONResponse(status_code=422, content=error_body(validation_detail(errors), errors))

    @app.exception_handler(PoolError)
    async def pool_error(_request: Request, error: PoolError) -> JSONResponse:
        headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
        return JSONResponse(status_code=error.status_code, content=error_body(str(error)), headers=headers)

    @app.exception_handler(StoreUnavailable)
    async def store_unavailable(_request: Request, error: StoreUnavailable) -> JSONResponse:
        return JSONResponse(status_code=503, content=error_body(f"{error}; retry in {STORE_RETRY_AFTER_S} s"),
                            headers={"Retry-After": str(STORE_RETRY_AFTER_S)})

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers. Says nothing about the store (see /readyz)."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"model": ErrorDetail}})
    async def readyz() -> dict[str, str]:
        """Readiness: the plan store answers a query and the solver pool runs; 503 with Retry-After if not."""
        if getattr(app.state, "pool", None) is None:
            raise PoolError("the solver pool is not running (the service is starting or stopping)", retry_after_s=1)
        await run_in_threadpool(app.state.store.check)
        return {"status": "ready"}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """Prometheus text format."""
        return Response(content=app.state.metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(plans.router)
    app.include_router(plans.alias_router)
    app.include_router(replan.router)
    app.include_router(detect.router)
    app.include_router(gpus.router)
    app.include_router(imports.router)
    app.include_router(calibrations.router)
    app.include_router(ui.router)
    document_bodies(app, (PlanRequest, EstimateRequest, ReplanRequest, plans.ViewLinkRequest, ImportRequest,
                          CompareRequest))
    detect.document_request_body(app)
    return app
