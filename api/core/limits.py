"""Body limits checked before a route parses anything: size per route (413), time to send it (408), JSON
nesting and encoding (422)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})
# A JSON string literal (escapes included), unrolled so long strings cost no backtracking.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
# Nesting depth does not care which kind of bracket: objects become arrays.
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")


@dataclass(frozen=True)
class BodyLimits:
    """max_bytes: default body limit. max_bytes_by_path: per-route limits (exact path). max_json_depth:
    nesting limit. depth_unchecked_paths: routes whose body is parsed off the event loop by a parser with
    its own nesting limit (pydantic's, 200 levels, a clean 422); counting there would cost the loop time."""

    max_bytes: int
    max_json_depth: int
    max_bytes_by_path: Mapping[str, int] = field(default_factory=dict)
    depth_unchecked_paths: frozenset[str] = frozenset()
    body_timeout_s: float = 30.0

    def max_bytes_for(self, path: str) -> int:
        return self.max_bytes_by_path.get(path, self.max_bytes)


def nested_deeper_than(body: bytes, limit: int) -> bool:
    """Whether arrays and objects in `body` nest more than `limit` levels (brackets in strings don't count;
    brackets left unclosed count as nesting). Linear time in C: no parse, no recursion."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    skeleton = _STRING.sub(b"", body).translate(_AS_SQUARE, _NOT_BRACKETS)
    too_deep = b"[" * (limit + 1)
    for _ in range(limit):
        if not skeleton:
            return False
        if too_deep in skeleton:  # settles the common deep case without `limit` passes over the body
            return True
        skeleton = skeleton.replace(b"[]", b"")  # one level off every innermost pair
    return bool(skeleton)


class BodyLimitMiddleware:
    """Reads the whole body (routes read it whole anyway), counting bytes as they arrive: over the route's
    limit it answers 413 at once, by Content-Length before reading anything when the client declares it;
    a body not complete `body_timeout_s` after its first byte was awaited is answered 408 (a slow sender
    would otherwise hold a connection, and a worker thread, forever). Then checks the bytes are UTF-8 and
    how deep the JSON nests, whatever the declared content type (every route parses its body as JSON), and
    hands the body on to the app."""

    def __init__(self, app: ASGIApp, limits: BodyLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _BODYLESS_METHODS:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        limit = self.limits.max_bytes_for(path)
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _reject(413, f"the request body is {int(declared):,} bytes; {path} accepts at most {limit:,} bytes",
                          scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        give_up_at = time.monotonic() + self.limits.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, give_up_at - time.monotonic()))
            except TimeoutError:
                await _reject(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s; "
                                   "send it at once after the headers", scope, _disconnected, send)
                return
            if message["type"] == "http.disconnect":
                return  # the client is gone: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _reject(413, f"the request body exceeds {limit:,} bytes, the most {path} accepts",
                              scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if path not in self.limits.depth_unchecked_paths:
            # FastAPI answers undecodable bytes with an undocumented 400; a malformed body is a 422 here.
            if not _is_utf8(body):
                await _reject(422, "the request body is not UTF-8 text; JSON must be sent as UTF-8",
                              scope, receive, send)
                return
            if nested_deeper_than(body, self.limits.max_json_depth):
                await _reject(422, f"the JSON body nests arrays and objects more than {self.limits.max_json_depth} "
                                   "levels deep (or leaves some unclosed); that is the most accepted", scope, receive, send)
                return
        await self.app(scope, _replay(body, receive), send)


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _replay(body: bytes, receive: Receive) -> Receive:
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replay


async def _disconnected() -> Message:
    # After a timed-out body nothing more is read from the client: the answer closes the exchange.
    return {"type": "http.disconnect"}


async def _reject(status: int, detail: str, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(status_code=status, content={"detail": detail})(scope, receive, send)
