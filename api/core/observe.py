"""Per request: an id (returned as X-Request-ID), one JSON log line, and the HTTP metrics."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Iterator

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.core.logs import REQUEST_ID
from api.core.metrics import Metrics

log = logging.getLogger("resiplan.http")

REQUEST_ID_HEADER = "X-Request-ID"
# A client's own id is kept if it is short and plain (it goes into logs and headers).
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class ObserveMiddleware:
    """Outermost middleware, so rejections by the others (401, 413) are logged and counted too.

    An exception no handler turned into a response becomes a JSON 500 here, logged with its traceback
    and the request id the client sees, instead of a bare text 500.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER.lower(), "")
        request_id = given if _CLIENT_ID.match(given) else uuid.uuid4().hex
        context = REQUEST_ID.set(request_id)
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status = message["status"]
                response_started = True
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, request_id)
            await send(message)

        self.metrics.in_progress.inc()
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error")
            if response_started:
                raise
            await JSONResponse(
                status_code=500, content={"detail": f"internal server error; request id {request_id}"}
            )(scope, receive, send_with_id)
        finally:
            duration_s = time.perf_counter() - started
            route = _route_template(scope)
            self.metrics.in_progress.dec()
            self.metrics.observe_request(scope["method"], route, status, duration_s)
            log.info(
                "%s %s %d %.1f ms", scope["method"], scope["path"], status, duration_s * 1e3,
                extra={"event": "request", "method": scope["method"], "path": scope["path"], "route": route,
                       "status": status, "duration_ms": round(duration_s * 1e3, 2),
                       "client": (scope.get("client") or ("", 0))[0]},
            )
            REQUEST_ID.reset(context)


def _route_template(scope: Scope) -> str:
    """The matched route's path template (`/v1/plans/{plan_id}`); for a request rejected before routing
    (401, 413), the template its path fits; "unmatched" otherwise, so unknown paths add no label values."""
    route = scope.get("route")
    if route is not None and hasattr(route, "path"):
        return route.path
    app = scope.get("app")
    for candidate in _leaf_routes(getattr(getattr(app, "router", None), "routes", ())):
        if candidate.path_regex.match(scope["path"]):
            return candidate.path
    return "unmatched"


def _leaf_routes(routes) -> Iterator:
    for route in routes:
        # Newer FastAPI keeps an included router as one wrapper entry; older versions list its routes.
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _leaf_routes(inner.routes)
        elif hasattr(route, "path_regex") and hasattr(route, "path"):
            yield route
