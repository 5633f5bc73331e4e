"""Authentication (on when RESIPLAN_API_TOKEN is set): a bearer token, or a signed view link to one plan.

- Every route that plans or reveals a plan — `/v1/*`, `POST /plan` and the plan page `/ui/*` — requires
  `Authorization: Bearer <token>`.
- A browser cannot send that header when it follows a link, so `POST /v1/plans/{id}/view-link` (with the
  token) hands out a short-lived signed link instead: `?expires=<unix s>&signature=<hex>`, an HMAC of the
  plan id and the expiry under a key derived from the token. It opens only the read-only views of that one
  plan (GET of the page, the plan JSON, its schedule SVG and exports) until it expires; changing the token
  revokes every link. The page carries the signature on its own links.
- `/healthz`, `/readyz`, `/metrics` (route templates and counts, no plan content), `/docs` and the OpenAPI
  schema stay open.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from dataclasses import dataclass
from urllib.parse import parse_qs

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

PROTECTED_PREFIXES = ("/v1", "/ui", "/plan")
EXPIRES_PARAM, SIGNATURE_PARAM = "expires", "signature"
# The read-only views of one plan a view link opens (GET and HEAD only).
_PLAN_VIEWS = re.compile(r"^/(?:ui/plans|v1/plans)/([0-9A-Za-z_-]{1,64})(?:/schedule\.svg|/export/[^/]{1,64})?$")
_SAFE_METHODS = frozenset({"GET", "HEAD"})
_KEY_CONTEXT = b"resiplan view link v1\0"


@dataclass(frozen=True)
class ViewLinks:
    """Signs and checks view links to one plan. The key is derived from the API token, never the token."""

    key: bytes

    @classmethod
    def for_token(cls, token: str) -> ViewLinks:
        return cls(hmac.new(token.encode(), _KEY_CONTEXT, hashlib.sha256).digest())

    def signature(self, plan_id: str, expires_unix_s: int) -> str:
        return hmac.new(self.key, f"{plan_id}\n{expires_unix_s}".encode(), hashlib.sha256).hexdigest()

    def query(self, plan_id: str, expires_unix_s: int) -> dict[str, str]:
        """The query parameters of a link to `plan_id` valid until `expires_unix_s`."""
        return {EXPIRES_PARAM: str(expires_unix_s), SIGNATURE_PARAM: self.signature(plan_id, expires_unix_s)}

    def valid(self, plan_id: str, expires: str, signature: str, now_unix_s: float) -> bool:
        if not expires.isascii() or not expires.isdigit() or len(expires) > 12 or int(expires) < now_unix_s:
            return False
        return hmac.compare_digest(self.signature(plan_id, int(expires)), signature)


def signed_view_query(scope: Scope) -> dict[str, str] | None:
    """The view-link parameters a request came with, if it was let in by one (for the page's own links)."""
    return scope.get("state", {}).get("view_link")


def _protected(path: str) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in PROTECTED_PREFIXES)


class BearerTokenMiddleware:
    """401 for a protected request with neither `Authorization: Bearer <token>` nor a valid view link.

    A middleware rather than a route dependency, so a route added later under a protected prefix cannot
    be left open by omission.
    """

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        # Compare digests: equal lengths, so compare_digest's time reveals nothing, not even the length.
        self._digest = hashlib.sha256(token.encode()).digest() if token else None
        self._links = ViewLinks.for_token(token) if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._digest is None or scope["type"] != "http" or not _protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        view_link = self._view_link(scope)
        if view_link is not None:
            scope.setdefault("state", {})["view_link"] = view_link
            await self.app(scope, receive, send)
            return
        scheme, _, credentials = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            await _unauthorized("this service requires a token: send the header 'Authorization: Bearer <token>' "
                                "(a browser opens a plan's page with a link from POST /v1/plans/{id}/view-link)",
                                'Bearer realm="resiplan"')(scope, receive, send)
            return
        given = hashlib.sha256(credentials.strip().encode()).digest()
        if not hmac.compare_digest(given, self._digest):
            await _unauthorized("the bearer token is not valid for this service",
                                'Bearer realm="resiplan", error="invalid_token"')(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _view_link(self, scope: Scope) -> dict[str, str] | None:
        """The link's parameters when this is a read of one plan's views with a valid, unexpired signature."""
        if self._links is None or scope["method"] not in _SAFE_METHODS:
            return None
        match = _PLAN_VIEWS.match(scope["path"])
        if match is None:
            return None
        try:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"), max_num_fields=16)
        except ValueError:  # more fields than any link of ours has
            return None
        expires, signature = query.get(EXPIRES_PARAM, [""])[-1], query.get(SIGNATURE_PARAM, [""])[-1]
        if not expires or not signature or not self._links.valid(match.group(1), expires, signature, time.time()):
            return None
        return {EXPIRES_PARAM: expires, SIGNATURE_PARAM: signature}


def _unauthorized(detail: str, challenge: str) -> JSONResponse:
    return JSONResponse(status_code=401, content={"detail": detail}, headers={"WWW-Authenticate": challenge})
