"""Request bodies parsed and validated off the event loop, in one strict way for every route.

FastAPI's own body handling runs `json.loads` and validation in the event loop (a 2 MB request stalls
every other client for its duration), accepts NaN and Infinity, and answers an integer of over 4,300
digits with an undocumented 400. Here a route declares

    request: Annotated[PlanRequest, json_body(PlanRequest)]

and the body is parsed by pydantic's own JSON parser in a worker thread: non-finite numbers are refused
by the models (`allow_inf_nan=False`), lone surrogates, too-deep nesting and out-of-range numbers are
JSON errors, and every failure is a `RequestBodyInvalid` (422, `wire.errors` shape). `document_bodies`
then puts the body schemas back into the OpenAPI document that FastAPI would have written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool

from wire.errors import RequestBodyInvalid

M = TypeVar("M", bound=BaseModel)

_SCHEMA_REF = "#/components/schemas/{model}"


def parse_body(model: type[M], body: bytes) -> M:
    """`body` as `model`, or RequestBodyInvalid saying what is wrong with it."""
    if not body.strip():
        raise RequestBodyInvalid(f"the request has no body; send a JSON {model.__name__} object")
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise RequestBodyInvalid.from_validation(error) from None


def json_body(model: type[M]) -> Any:
    """A dependency yielding the request body as `model` (see the module docstring)."""

    async def parsed(request: Request) -> M:
        return await run_in_threadpool(parse_body, model, await request.body())

    return Depends(parsed)


def body_openapi(model: type[BaseModel], examples: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`openapi_extra` of a route whose body is `model` (FastAPI documents only bodies it parses itself)."""
    content: dict[str, Any] = {"schema": {"$ref": _SCHEMA_REF.format(model=model.__name__)}}
    if examples:
        content["examples"] = dict(examples)
    return {"requestBody": {"required": True, "content": {"application/json": content}}}


def document_bodies(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Add `models` (and the models they use) to the app's OpenAPI components, for `body_openapi` refs."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        _, definitions = models_json_schema([(model, "validation") for model in models], ref_template=_SCHEMA_REF)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in definitions.get("$defs", {}).items():
            components.setdefault(name, definition)
        return schema

    app.openapi = openapi
