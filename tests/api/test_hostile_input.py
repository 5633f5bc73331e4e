"""What a hostile or careless client can send, on every route that takes it: always a 4xx in the one error shape
(`detail` a sentence, `errors` naming fields), never a 500, never a hang.

NaN / Infinity and lone UTF-16 surrogates used to answer 500 (FastAPI's 422 handler echoed the input and could
not encode it); integers of over 4,300 digits answered an undocumented 400; a body declared `application/JSON`
skipped the nesting check.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from api.core.limits import BodyLimitMiddleware, BodyLimits
from tests.api.support import (
    assert_detail,
    assert_validation,
    detail_422,
    estimate_request,
    small_request,
)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A client and the id of a plan it stored (replan, view-link and detect bodies need one)."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.core.settings import Settings

    settings = Settings(database_url=f"sqlite:///{tmp_path_factory.mktemp('hostile')}/h.db", solver_workers=1)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        created = client.post("/v1/plan", json=small_request())
        assert created.status_code == 200, created.text
        yield client, created.json()["plan_id"]


def _bodies(plan_id: str) -> dict[str, tuple[str, str]]:
    """Route -> (a valid body as JSON text, the text of one float in it to replace)."""
    detect = {"plan_id": plan_id, "telemetry": [
        {"device": "0:0", "iteration": 1, "microbatches": [{"seq_lengths": [2048], "compute_ms": 40.25}],
         "last_heartbeat_s_ago": 0.5}]}
    return {
        "/v1/plan": (json.dumps(small_request(options={"time_limit_s": 2.5})), "2.5"),
        "/plan": (json.dumps(small_request(options={"time_limit_s": 2.5})), "2.5"),
        "/v1/estimate": (json.dumps(estimate_request({"tp": 2, "pp": 2}, options={"time_limit_s": 2.5})), "2.5"),
        f"/v1/plans/{plan_id}/replan": (json.dumps({"failures": {"slow": [{"device": "0:1", "speed": 0.5}]}}), "0.5"),
        "/v1/detect": (json.dumps(detect), "40.25"),
    }


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize("route", ["/v1/plan", "/plan", "/v1/estimate", "replan", "/v1/detect"])
def test_non_finite_numbers_are_a_clear_422_on_every_route(stored, route, constant):
    client, plan_id = stored
    route = f"/v1/plans/{plan_id}/replan" if route == "replan" else route
    body, number = _bodies(plan_id)[route]
    assert number in body
    response = client.post(route, content=body.replace(number, constant, 1), headers={"content-type": "application/json"})
    detail = detail_422(response)
    assert "finite" in detail, detail


@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "\\ud800x", "\\udc00\\ud800"])
@pytest.mark.parametrize("route", ["/v1/plan", "/v1/estimate", "replan", "/v1/detect"])
def test_a_lone_surrogate_in_any_string_is_a_clear_422(stored, route, escape):
    client, plan_id = stored
    route = f"/v1/plans/{plan_id}/replan" if route == "replan" else route
    body, _ = _bodies(plan_id)[route]
    hostile = body.replace('"0:', f'"{escape}0:', 1) if "replan" in route or "detect" in route \
        else body.replace('"A100-80GB"', f'"A100{escape}"', 1)
    assert hostile != body
    response = client.post(route, content=hostile, headers={"content-type": "application/json"})
    detail = detail_422(response)  # and the answer itself is valid JSON
    assert "JSON" in detail or "unicode" in detail, detail


def test_a_proper_surrogate_pair_is_just_a_character(stored):
    client, _ = stored
    body = small_request(cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100\U0001F600"})
    assert_detail(client.post("/v1/plan", json=body), "unknown GPU preset", "\U0001F600")


def test_an_integer_of_thousands_of_digits_is_a_422(stored):
    client, _ = stored
    body = json.dumps(small_request()).replace('"global_batch_size": 32', '"global_batch_size": ' + "7" * 5000)
    assert_detail(client.post("/v1/plan", content=body, headers={"content-type": "application/json"}),
                  "not valid JSON", "number out of range")


@pytest.mark.parametrize("content_type", ["application/JSON", "Application/Json; charset=UTF-8", "text/plain", ""])
def test_the_nesting_limit_holds_whatever_the_declared_content_type(stored, content_type):
    client, _ = stored
    deep = "[" * 600 + "]" * 600
    headers = {"content-type": content_type} if content_type else {}
    assert_detail(client.post("/v1/plan", content=deep, headers=headers), "nests arrays and objects more than 32")


@pytest.mark.parametrize("content_type", ["application/JSON", "text/plain"])
def test_a_valid_body_is_planned_whatever_the_declared_content_type(stored, content_type):
    client, _ = stored
    response = client.post("/v1/plan", content=json.dumps(small_request()), headers={"content-type": content_type})
    assert response.status_code == 200, response.text


def test_an_empty_body_says_what_to_send(stored):
    client, _ = stored
    assert_detail(client.post("/v1/plan", content=b""), "no body", "PlanRequest")


def test_query_and_path_errors_have_the_same_shape(stored):
    client, plan_id = stored
    for url in (f"/v1/plans/{plan_id}/export/json?replica=abc", f"/ui/plans/{plan_id}?replica=-1",
                f"/v1/plans/{plan_id}/schedule.svg?replica={'9' * 400}"):
        error = assert_validation(client.get(url), ("replica",))
        assert error["field"] == "query parameter replica", error


def test_every_export_refuses_a_replica_the_plan_lacks(stored):
    """`?replica=99` on the JSON export answered 200 where every other format answered 422."""
    client, plan_id = stored
    replicas = len(client.get(f"/v1/plans/{plan_id}").json()["replicas"])
    for name in ("json", "torch-csv", "svg"):
        assert_detail(client.get(f"/v1/plans/{plan_id}/export/{name}?replica=99"), "no replica 99",
                      f"0..{replicas - 1}")
        assert client.get(f"/v1/plans/{plan_id}/export/{name}?replica=0").status_code == 200


def test_the_unversioned_plan_route_is_the_same_route(stored):
    client, _ = stored
    versioned, alias = client.post("/v1/plan", json=small_request()), client.post("/plan", json=small_request())
    assert versioned.status_code == alias.status_code == 200
    drop = {"plan_id", "solver"}
    assert {k: v for k, v in alias.json().items() if k not in drop} == \
        {k: v for k, v in versioned.json().items() if k not in drop}
    assert client.get(f"/v1/plans/{alias.json()['plan_id']}").status_code == 200
    operations = client.get("/openapi.json").json()["paths"]
    assert operations["/plan"]["post"]["requestBody"] == operations["/v1/plan"]["post"]["requestBody"] | {
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PlanRequest"}}}}


def test_a_body_sent_too_slowly_is_answered_408_and_released():
    """A client that sends its headers (and token) then trickles the body cannot hold the connection."""
    sent: list[dict] = []
    reached_app: list[bool] = []

    async def app(scope, receive, send):
        reached_app.append(True)

    async def trickle():
        await asyncio.sleep(3600)  # the rest of the body never comes
        return {"type": "http.request", "body": b"}", "more_body": False}

    async def send(message):
        sent.append(message)

    middleware = BodyLimitMiddleware(app, BodyLimits(max_bytes=1 << 20, max_json_depth=32, body_timeout_s=0.05))
    scope = {"type": "http", "method": "POST", "path": "/v1/plan", "headers": [], "query_string": b""}
    asyncio.run(asyncio.wait_for(middleware(scope, trickle, send), timeout=30))
    assert sent[0]["status"] == 408 and not reached_app
    assert "did not arrive within 0.05 s" in json.loads(sent[1]["body"])["detail"]
