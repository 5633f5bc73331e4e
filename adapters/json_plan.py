"""The plan itself, as the service returns it."""

from __future__ import annotations

import re
from typing import Any

from pydantic_core import PydanticSerializationError

from wire.schemas import Plan

_SURROGATE = re.compile("[\ud800-\udfff]")


def render(plan: Plan, replica_id: int | None = None) -> str:
    try:
        return plan.model_dump_json(indent=2) + "\n"
    except PydanticSerializationError:
        # A plan read with json.loads can hold lone surrogates (from "\ud800" escapes), which UTF-8
        # cannot encode: they become U+FFFD, the replacement character, like any undecodable text.
        cleaned = Plan.model_validate(_without_surrogates(plan.model_dump()))
        return cleaned.model_dump_json(indent=2) + "\n"


def _without_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_without_surrogates(key): _without_surrogates(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_without_surrogates(item) for item in value)
    return value
