"""A typed client of the resiplan service (API.md v1) for trainer launchers and schedulers.

    with PlannerClient("http://planner:8000", token=os.environ.get("RESIPLAN_API_TOKEN")) as planner:
        plan = planner.plan(request)             # POST /v1/plan -> validated wire.schemas.Plan
        args = planner.export(plan.plan_id, "megatron")

Retries, with exponential backoff (`backoff_s * 2**attempt`, capped at `max_backoff_s`, plus up to
`jitter` of itself drawn from `rng`), happen only where repeating cannot do harm or double work:

- the connection could not be made (refused, DNS, connect or pool timeout): the server never saw it;
- 503 Service Unavailable (the server's `Retry-After`, seconds or an HTTP date, replaces the backoff,
  capped at `max_backoff_s`), and 502/504 from a gateway in front of the service;
- for GET only, a connection lost or a read timeout while waiting for the answer.

A POST whose answer does not arrive in time is not repeated: the server may still be solving it and
a second solve would double the load; raise `timeout_s` instead. 4xx answers (the request is wrong
or cannot be satisfied) and 500 (a server bug; the same request would fail again) are never retried.
Every failure is a `PlannerError` whose message is one line a launcher can print.

The solve itself takes up to the request's `options.time_limit_s`, so `plan()` waits for the answer
at least that long plus `SOLVE_MARGIN_S` (for request handling, schedule simulation and storage).
"""

from __future__ import annotations

import email.utils
import json
import math
import random
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from wire.detection import DetectResponse
from wire.schemas import Failures, Options, Plan, PlanRequest

__all__ = ["RETRY_STATUSES", "SOLVE_MARGIN_S", "PlannerClient", "PlannerError"]

RETRY_STATUSES = frozenset({502, 503, 504})
SOLVE_MARGIN_S = 30.0
USER_AGENT = "resiplan-client/0.1"
_MAX_DETAIL_CHARS = 2000


class PlannerError(Exception):
    """The service could not be reached or refused the call.

    `status_code` is the HTTP status (None when no answer arrived); `detail` is the server's `detail`
    text (None when there was no answer). `str(error)` is a one-line message for the user.
    """

    def __init__(self, message: str, *, status_code: int | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail


class PlannerClient:
    """Synchronous client of one resiplan service.

    `transport` replaces the network (httpx.MockTransport in tests); `http` is an existing httpx.Client
    to send through instead of an own one (e.g. a FastAPI TestClient), which `close()` leaves open.
    `sleep` and `rng` make the retry delays observable and deterministic; `rng=None` with `jitter > 0`
    draws jitter from a fresh unseeded generator.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 120.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        jitter: float = 0.1,
        connect_timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        http: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if backoff_s < 0 or max_backoff_s < 0 or jitter < 0:
            raise ValueError("backoff_s, max_backoff_s and jitter must be >= 0")
        if http is not None and transport is not None:
            raise ValueError("pass either transport or http, not both")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.jitter = jitter
        self._sleep = sleep
        self._rng = rng if rng is not None else random.Random()
        self._headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._owns_http = http is None
        self._http = http if http is not None else httpx.Client(transport=transport, follow_redirects=False)

    # -- the API -------------------------------------------------------------------------------------------

    def plan(self, request: PlanRequest | Mapping[str, Any]) -> Plan:
        """POST /v1/plan: the best layout for the request. A dict is validated as a PlanRequest first."""
        request = request if isinstance(request, PlanRequest) else PlanRequest.model_validate(request)
        response = self._call(
            "POST", "/v1/plan",
            body=request.model_dump(mode="json", exclude_unset=True),
            read_timeout_s=self._solve_timeout(request.options.time_limit_s),
        )
        return self._plan_from(response)

    def get(self, plan_id: str) -> Plan:
        """GET /v1/plans/{plan_id}: a stored plan (PlannerError with status 404 if unknown)."""
        return self._plan_from(self._call("GET", f"/v1/plans/{_segment(plan_id)}"))

    def replan(
        self,
        plan_id: str,
        failures: Failures | Mapping[str, Any],
        options: Options | Mapping[str, Any] | None = None,
    ) -> Plan:
        """POST /v1/plans/{plan_id}/replan with the complete failure state now.

        Only the options given are sent (none: the key is left out), so the server's choice for the
        rest, e.g. the parent plan's, is not overridden by this client's defaults.
        """
        failures = failures if isinstance(failures, Failures) else Failures.model_validate(failures)
        body: dict[str, Any] = {"failures": failures.model_dump(mode="json")}
        read_timeout_s = self.timeout_s
        if options is not None:
            options = options if isinstance(options, Options) else Options.model_validate(options)
            body["options"] = options.model_dump(mode="json", exclude_unset=True)
            if "time_limit_s" in options.model_fields_set:
                read_timeout_s = self._solve_timeout(options.time_limit_s)
        response = self._call("POST", f"/v1/plans/{_segment(plan_id)}/replan", body=body, read_timeout_s=read_timeout_s)
        return self._plan_from(response)

    def detect(self, plan_id: str, telemetry: list[Mapping[str, Any]]) -> DetectResponse:
        """POST /v1/detect: fail-slow and fail-stop devices of a stored plan in a window of telemetry items."""
        response = self._call("POST", "/v1/detect", body={"plan_id": plan_id, "telemetry": list(telemetry)},
                              read_timeout_s=self.timeout_s)
        try:
            return DetectResponse.model_validate(response.json())
        except (ValueError, ValidationError) as error:
            raise PlannerError(f"POST /v1/detect: the answer is not a detection: {_one_line(str(error))}",
                               status_code=response.status_code) from None

    def export(self, plan_id: str, fmt: str, replica: int | None = None) -> str:
        """GET /v1/plans/{plan_id}/export/{fmt}: the plan as text in that format (`resiplan export --help`)."""
        params = {"replica": replica} if replica is not None else None
        response = self._call("GET", f"/v1/plans/{_segment(plan_id)}/export/{_segment(fmt)}", params=params, accept="*/*")
        return response.text

    # -- lifecycle -----------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------------------

    def _solve_timeout(self, time_limit_s: float) -> float:
        return max(self.timeout_s, time_limit_s + SOLVE_MARGIN_S)

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        read_timeout_s: float | None = None,
        accept: str | None = None,
    ) -> httpx.Response:
        url = f"{self.base_url}{path}"
        read_s = read_timeout_s if read_timeout_s is not None else self.timeout_s
        # (connect, read, write, pool) as a plain tuple, which httpx and httpx2 (Starlette's TestClient) both
        # take: httpx2 2.17 refuses an httpx.Timeout object.
        timeout = (self.connect_timeout_s, read_s, read_s, read_s)
        headers = {**self._headers, "Accept": accept} if accept else self._headers
        idempotent = method in ("GET", "HEAD")
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self._http.request(method, url, json=body, params=params, headers=headers, timeout=timeout)
            except (httpx.InvalidURL, httpx.UnsupportedProtocol) as error:
                raise PlannerError(f"cannot reach the planner at {self.base_url!r}: {error}") from error
            except httpx.TransportError as error:
                if attempt > self.retries or not _may_retry(error, idempotent):
                    raise PlannerError(self._transport_message(error, method, path, attempt, read_s)) from error
                delay = self._backoff(attempt)
            else:
                if response.is_success:
                    return response
                if attempt > self.retries or response.status_code not in RETRY_STATUSES:
                    raise self._status_error(response, method, path, attempt)
                retry_after = _retry_after_s(response)
                delay = min(retry_after, self.max_backoff_s) if retry_after is not None else self._backoff(attempt)
                response.close()
            self._sleep(delay)

    def _backoff(self, attempt: int) -> float:
        """Delay before retry number `attempt` (1-based): backoff_s, 2 backoff_s, 4 backoff_s ... capped."""
        delay = self.backoff_s * 2.0 ** min(attempt - 1, 60)
        if self.jitter:
            delay *= 1.0 + self.jitter * self._rng.random()
        return min(delay, self.max_backoff_s)

    def _transport_message(self, error: httpx.TransportError, method: str, path: str, attempts: int, read_s: float) -> str:
        tries = f" (tried {attempts} times)" if attempts > 1 else ""
        reason = str(error) or type(error).__name__
        if isinstance(error, httpx.ConnectTimeout):
            return f"cannot reach the planner at {self.base_url}: no connection within {self.connect_timeout_s:g} s{tries}"
        if isinstance(error, (httpx.ConnectError, httpx.PoolTimeout)):
            return f"cannot reach the planner at {self.base_url}: {reason}{tries}"
        if isinstance(error, httpx.ReadTimeout):
            hint = "" if method in ("GET", "HEAD") else "; it may still be solving, allow a longer timeout"
            return f"the planner at {self.base_url} did not answer {method} {path} within {read_s:g} s{tries}{hint}"
        return f"lost the connection to the planner at {self.base_url} during {method} {path}: {reason}{tries}"

    def _status_error(self, response: httpx.Response, method: str, path: str, attempts: int) -> PlannerError:
        detail = _detail_text(response)
        status = response.status_code
        line = _one_line(detail)
        if 400 <= status < 500:
            what = "refused" if status == 422 else "rejected"
            message = f"the planner {what} {method} {path} (HTTP {status}): {line}"
        else:
            tries = f" after {attempts} attempts" if attempts > 1 else ""
            message = f"the planner at {self.base_url} failed {method} {path} (HTTP {status}{tries}): {line}"
        return PlannerError(message, status_code=status, detail=detail)

    def _plan_from(self, response: httpx.Response) -> Plan:
        try:
            return Plan.model_validate(response.json())
        except (ValueError, ValidationError) as error:  # json.JSONDecodeError is a ValueError
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise PlannerError(
                f"the planner at {self.base_url} answered {response.request.url.path} with something that is not "
                f"a Plan ({first_line}); is it a resiplan v1 service?",
                status_code=response.status_code,
            ) from error


def _segment(value: str) -> str:
    """One URL path segment: '/' and '..' in an id cannot reach another route."""
    if not isinstance(value, str) or not value or value in (".", ".."):
        raise ValueError(f"not a valid id: {value!r}")
    return quote(value, safe="")


def _may_retry(error: httpx.TransportError, idempotent: bool) -> bool:
    # The request never left: always safe. Anything later: only when repeating it is harmless.
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
        return True
    return idempotent and isinstance(error, (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError))


def _retry_after_s(response: httpx.Response) -> float | None:
    """Retry-After as seconds from now (delta-seconds or an HTTP date), None when absent or unreadable."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def _detail_text(response: httpx.Response) -> str:
    """The server's `detail`: FastAPI's string as-is, its validation errors as `loc: msg; ...`, else the body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        if isinstance(detail, str):
            text = detail
        elif isinstance(detail, list):
            text = "; ".join(_validation_item(item) for item in detail)
        else:
            text = json.dumps(detail)
    else:
        text = response.text.strip()[:_MAX_DETAIL_CHARS] or response.reason_phrase or "no detail"
    return text


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_DETAIL_CHARS else text[: _MAX_DETAIL_CHARS - 3] + "..."


def _validation_item(item: Any) -> str:
    if not isinstance(item, dict):
        return str(item)
    loc = [str(part) for part in item.get("loc", [])]
    if loc[:1] == ["body"]:
        loc = loc[1:]
    return f"{'.'.join(loc) or '(body)'}: {item.get('msg', item)}"
