"""The one error shape every route answers with, and pydantic errors turned into sentences for people.

    {"detail": "training.seq_length: Input should be greater than or equal to 1",
     "errors": [{"field": "training.seq_length", "message": "Input should be greater than or equal to 1"}]}

`detail` is always one human sentence; `errors` (validation failures only) lists each failing field by its
path in the request (`failures.slow[0].speed`, `telemetry[12].microbatches[3].compute_ms`). Nothing a client
sent is echoed back: an echo of NaN or of a lone surrogate cannot be encoded as JSON (that was a 500), and an
echo of a 24 MB body would be another 24 MB.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

# Where FastAPI says a parameter came from; the body is the request itself, so it is not named.
_PARAMETER_SOURCES = {"query": "query parameter", "path": "path parameter", "header": "header", "cookie": "cookie"}
# Pydantic prefixes messages of errors raised in validators; the sentence reads better without it.
_MESSAGE_PREFIXES = ("Value error, ", "Assertion failed, ")
# A sentence naming more fields than this says how many more there are instead.
_FIELDS_IN_DETAIL = 3


def error_body(detail: str, errors: Sequence[Mapping[str, str]] | None = None) -> dict[str, Any]:
    """The JSON of an error answer: `detail` always, `errors` when fields failed validation."""
    body: dict[str, Any] = {"detail": detail}
    if errors:
        body["errors"] = [{"field": error["field"], "message": error["message"]} for error in errors]
    return body


def field_path(loc: Iterable[str | int]) -> str:
    """`("failures", "slow", 0, "speed")` -> `failures.slow[0].speed`. Union member tags (`<preset>`, ...,
    see wire.schemas) are left out: they name the form a value was read as, not a field."""
    path = ""
    for part in loc:
        if isinstance(part, str) and part.startswith("<") and part.endswith(">"):
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _message(raw: str) -> str:
    for prefix in _MESSAGE_PREFIXES:
        if raw.startswith(prefix):
            return raw[len(prefix):]
    return raw


def field_errors(items: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Pydantic / FastAPI error items (`loc`, `msg`) as `{"field", "message"}`, inputs left out.

    FastAPI's locations start with where the value came from: "body" is dropped (the body is the request),
    "query" / "path" become "query parameter replica" and the like.
    """
    errors = []
    for item in items:
        loc = list(item.get("loc", ()))
        source = ""
        if loc and loc[0] == "body":
            loc = loc[1:]
        elif loc and loc[0] in _PARAMETER_SOURCES:
            source = _PARAMETER_SOURCES[loc[0]] + " "
            loc = loc[1:]
        message = _message(str(item.get("msg", "invalid")))
        if item.get("type") == "json_invalid":
            message = "the request body is not valid JSON: " + message.removeprefix("Invalid JSON: ")
        errors.append({"field": source + field_path(loc), "message": message})
    return errors


def validation_detail(errors: Sequence[Mapping[str, str]]) -> str:
    """One sentence naming the failing fields: `a: msg; b: msg` (and how many more)."""
    if not errors:
        return "the request is invalid"
    parts = [f"{error['field']}: {error['message']}" if error["field"] else error["message"]
             for error in errors[:_FIELDS_IN_DETAIL]]
    more = len(errors) - _FIELDS_IN_DETAIL
    if more > 0:
        parts.append(f"and {more} more problem{'s' if more > 1 else ''} (see errors)")
    return "; ".join(parts)


class RequestBodyInvalid(Exception):
    """A body that is not valid JSON for its route, or fails the route's schema; answered 422."""

    def __init__(self, detail: str, errors: Sequence[Mapping[str, str]] = ()) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = list(errors)

    def __reduce__(self):
        # Raised in solver workers: it must cross back to the server with its field list.
        return type(self), (self.detail, self.errors)

    @classmethod
    def from_validation(cls, error: ValidationError) -> RequestBodyInvalid:
        errors = field_errors(error.errors(include_url=False, include_input=False, include_context=False))
        # A body that is not JSON at all names no field: the sentence alone says it.
        return cls(validation_detail(errors), [error for error in errors if error["field"]])
