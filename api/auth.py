"""Bearer-token authentication of the /v1 routes (on when RESIPLAN_API_TOKEN is set)."""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

PROTECTED_PREFIX = "/v1"


class BearerTokenMiddleware:
    """401 for a /v1 request without `Authorization: Bearer <token>` matching the server's token.

    A middleware rather than a route dependency, so a route added later under /v1 cannot be left
    open by omission. /healthz, /metrics, /docs and /ui stay open.
    """

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        # Compare digests: equal lengths, so compare_digest's time reveals nothing, not even the length.
        self._digest = hashlib.sha256(token.encode()).digest() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._digest is None or scope["type"] != "http" or not _protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        scheme, _, credentials = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            await _unauthorized("this service requires a token: send the header 'Authorization: Bearer <token>'",
                                'Bearer realm="resiplan"')(scope, receive, send)
            return
        given = hashlib.sha256(credentials.strip().encode()).digest()
        if not hmac.compare_digest(given, self._digest):
            await _unauthorized("the bearer token is not valid for this service",
                                'Bearer realm="resiplan", error="invalid_token"')(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


def _unauthorized(detail: str, challenge: str) -> JSONResponse:
    return JSONResponse(status_code=401, content={"detail": detail}, headers={"WWW-Authenticate": challenge})
