"""docs/API.md (the wire contract shipped in the repository) against the service's own OpenAPI schema.

The contract is a document people read; these checks keep it from promising routes or fields the service
does not have, except what the document itself lists under "Not yet in this version".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from api.app import create_app
from api.core.settings import Settings
from wire.schemas import Plan, PlanRequest

CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "API.md"
ROUTE = re.compile(r"`(GET|POST) (/[^`\s]*)`|^## (GET|POST) (/\S+)", re.MULTILINE)


def _sections() -> tuple[str, str]:
    text = CONTRACT.read_text()
    preface, _, contract = text.partition("\n---\n")
    assert contract, "docs/API.md: the contract follows the preface after a '---' line"
    return preface, contract


def _routes(text: str) -> set[tuple[str, str]]:
    found = set()
    for match in ROUTE.finditer(text):
        method, path = (match.group(1), match.group(2)) if match.group(1) else (match.group(3), match.group(4))
        found.add((method, re.sub(r"\{[^}]+\}", "{}", path.rstrip(".,;:"))))
    return found


def _served_routes() -> set[tuple[str, str]]:
    """Every route of the app, those left out of the OpenAPI schema (/metrics) included."""
    paths = create_app(Settings(database_url="sqlite://")).openapi()["paths"]
    served = {(method.upper(), re.sub(r"\{[^}]+\}", "{}", path)) for path, item in paths.items() for method in item}
    for route in create_app(Settings(database_url="sqlite://")).routes:
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                served.add((method, re.sub(r"\{[^}]+\}", "{}", route.path)))
    return served


def test_every_route_the_contract_names_is_served_or_declared_missing():
    preface, contract = _sections()
    not_yet = _routes(preface.split("Served beyond the contract")[0])
    served = _served_routes()
    promised = _routes(contract)
    assert promised, "no routes found in the contract"
    missing = sorted(promised - served - not_yet)
    assert not missing, f"docs/API.md promises routes the service lacks: {missing}"
    stale = sorted(not_yet & served)
    assert not stale, f"docs/API.md lists as missing routes the service now has: {stale}"
    beyond = _routes(preface.split("Served beyond the contract")[1])
    assert beyond <= served, sorted(beyond - served)
    undocumented = sorted(route for route in served - promised - beyond
                          if not route[1].startswith(("/docs", "/redoc", "/openapi", "/static")))
    assert not undocumented, f"routes served but named nowhere in docs/API.md: {undocumented}"


def _json_blocks(text: str) -> list[str]:
    return re.findall(r"```json\n(.*?)```", text, re.DOTALL)


def test_the_contracts_plan_request_example_validates():
    _, contract = _sections()
    request = json.loads(_json_blocks(contract)[0])
    assert PlanRequest.model_validate(request).cluster.num_nodes == 32


def _model_in(annotation):
    """The pydantic model inside `X`, `X | None`, `list[X]`."""
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return annotation
    for argument in getattr(annotation, "__args__", ()):
        found = _model_in(argument)
        if found is not None:
            return found
    return None


def test_every_field_of_the_contracts_plan_example_is_a_plan_field():
    _, contract = _sections()
    example = json.loads(next(block for block in _json_blocks(contract) if '"plan_id"' in block).replace("…", ""))

    def fields(model, value, path="") -> None:
        for key, item in value.items():
            assert key in model.model_fields, f"{path}{key} is not a field of {model.__name__}"
            nested = _model_in(model.model_fields[key].annotation)
            if isinstance(item, dict) and nested is not None:
                fields(nested, item, f"{path}{key}.")
            elif isinstance(item, list) and item and isinstance(item[0], dict):
                fields(nested, item[0], f"{path}{key}[0].")

    fields(Plan, example)

