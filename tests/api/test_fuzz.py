"""Schemathesis against the service's own OpenAPI schema: no 5xx, every response as documented.

Every operation is fuzzed in-process (ASGI) with valid and invalid inputs, derandomized so a
run is reproducible. Generated plan ids would all be unknown (404), so about half of the cases
are pointed at a plan stored beforehand (and at known export formats and replica 0): the
exports, the SVG, the plan page, replanning and the detector then run on real data with fuzzed
query values, failures and telemetry.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.python.asgi import get_client, shutdown_lifespans
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from adapters.registry import format_names
from api.app import create_app
from api.core.settings import Settings
from api.core.store import PlanStore, make_engine
from api.tasks.planning import plan_for
from tests.api.support import small_request
from wire.schemas import PlanRequest

# Solver budget of every fuzzed plan: what is tested is the response, not the plan's quality.
FUZZ_TIME_LIMIT_S = 0.2
EXAMPLES_PER_OPERATION = 25
# Known limit, not fuzzed: every plan lists each stage's ops per microbatch, and building those
# timelines ignores the time limit (1,048,576 sequences: 150 s and a 53 MB answer; README "Known limits").
MAX_FUZZED_GLOBAL_BATCH = 512
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def stored_plan_id(tmp_path_factory) -> tuple[str, str]:
    """A database holding one real plan, and that plan's id."""
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz')}/fuzz.db"
    request = PlanRequest.model_validate(small_request())
    plan = plan_for(request)
    store = PlanStore(make_engine(url))
    store.save(plan.plan_id, request.model_dump(mode="json"), plan.model_dump(mode="json"))
    store.close()
    return url, plan.plan_id


@pytest.fixture(scope="module")
def fuzz_client(stored_plan_id):
    """An in-process client of a service whose solver budget is capped at FUZZ_TIME_LIMIT_S."""
    url, _ = stored_plan_id
    app = create_app(Settings(database_url=url, max_time_limit_s=FUZZ_TIME_LIMIT_S))
    with get_client(app) as client:  # runs the app's lifespan (opens the store)
        yield client
    # Schemathesis keeps a started lifespan running for the whole process; end it (closing the store) here.
    shutdown_lifespans()


def _openapi() -> dict:
    # Building the schema runs no lifespan, so nothing is opened at import.
    return create_app(Settings(database_url="sqlite://")).openapi()


schema = schemathesis.openapi.from_dict(_openapi())


def _within_schedule_limit(case) -> None:
    """Cap the global batch of generated plan requests (see MAX_FUZZED_GLOBAL_BATCH)."""
    training = case.body.get("training") if isinstance(case.body, dict) else None
    if isinstance(training, dict) and type(training.get("global_batch_size")) is int:
        training["global_batch_size"] = min(training["global_batch_size"], MAX_FUZZED_GLOBAL_BATCH)


def _aim_at_stored_plan(case, plan_id: str) -> None:
    """Point about half the cases at real things, deterministically (by the generated value's parity):
    the stored plan instead of an unknown id, a known export format, replica 0 (every plan has it)."""
    path = case.path_parameters or {}
    if isinstance(path.get("plan_id"), str) and len(path["plan_id"]) % 2 == 0:
        path["plan_id"] = plan_id
    if isinstance(path.get("format_name"), str) and len(path["format_name"]) % 2 == 0:
        formats = format_names()
        path["format_name"] = formats[len(path["format_name"]) % len(formats)]
    query = case.query or {}
    if type(query.get("replica")) is int and query["replica"] % 2 == 0:
        query["replica"] = 0
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("plan_id"), str) and len(body["plan_id"]) % 2 == 0:
        body["plan_id"] = plan_id


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_every_response_is_documented_and_no_server_error(case, fuzz_client, stored_plan_id):
    _, plan_id = stored_plan_id
    _aim_at_stored_plan(case, plan_id)
    _within_schedule_limit(case)
    case.call_and_validate(base_url="http://testserver", session=fuzz_client, checks=CHECKS)
