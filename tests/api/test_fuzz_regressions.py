"""What the schema fuzzer (test_fuzz.py) found, pinned as plain tests: each was a 500, a 400 the schema
does not declare, or a 200 whose numbers were NaN/inf (sent as null)."""

from __future__ import annotations

import pytest

from tests.api.support import assert_detail, assert_validation, small_request
from wire.schemas import ErrorDetail

TINY = 5e-324  # the smallest positive float: "greater than 0" let it through


@pytest.mark.parametrize("field", ["inter_node_bandwidth_gb_s", "intra_node_bandwidth_gb_s"])
@pytest.mark.parametrize("route", ["/v1/plan", "/v1/estimate"])
def test_a_vanishing_bandwidth_is_rejected(client, route, field):
    """Was a 500 (ZeroDivisionError in point_to_point_s) for /v1/plan and a 200 with null times for
    /v1/estimate: a 5e-324 GB/s link makes every transfer take forever."""
    cluster = {"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB", field: TINY}
    layout = {"layout": {"tp": 2, "pp": 2}} if route == "/v1/estimate" else {}
    body = small_request(cluster=cluster, **layout)
    assert_validation(client.post(route, json=body), ("cluster", field), "greater than or equal to 0.01")


@pytest.mark.parametrize(
    ("field", "minimum"), [("peak_tflops", "0.1"), ("memory_gib", "0.1"), ("hbm_bandwidth_gb_s", "0.01")]
)
def test_a_vanishing_custom_gpu_rate_is_rejected(client, field, minimum):
    gpu = {"name": "tiny", "peak_tflops": 300, "memory_gib": 80, field: TINY}
    body = small_request(cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": gpu})
    response = client.post("/v1/plan", json=body)
    assert_validation(response, ("cluster", "gpu", field), f"greater than or equal to {minimum}")


def test_the_slowest_speed_the_detector_reports_is_accepted(client):
    """The lower bound on `speed` is the detector's floor, so a detected speed can always be replanned with."""
    body = small_request(failures={"slow": [{"device": "0:1", "speed": 0.001}]})
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 200, response.text
    assert {"device": "0:1", "speed": 0.001} in response.json()["slow_devices"]


@pytest.mark.parametrize("route", ["/v1/plan", "/v1/estimate"])
def test_a_body_that_is_not_utf8_is_a_422(client, route):
    """Was FastAPI's undeclared 400 "There was an error parsing the body"."""
    response = client.post(route, content=b'{"model": "\xff\xfe"}', headers={"content-type": "application/json"})
    assert_detail(response, "not UTF-8")


def _plan_id(client) -> str:
    created = client.post("/v1/plan", json=small_request())
    assert created.status_code == 200, created.text
    return created.json()["plan_id"]


@pytest.mark.parametrize("query", ["replica=-159618", "replica=AAA"])
def test_plan_page_errors_are_json_as_the_schema_declares(client, query):
    """The page is HTML, but its 422 is JSON; the schema declared FastAPI's list-of-errors model under text/html."""
    response = client.get(f"/ui/plans/{_plan_id(client)}?{query}")
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/json"
    openapi = client.get("/openapi.json").json()
    declared = openapi["paths"]["/ui/plans/{plan_id}"]["get"]["responses"]["422"]
    assert declared["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorDetail"}
    assert set(openapi["components"]["schemas"]["ErrorDetail"]["properties"]) == set(ErrorDetail.model_fields)
    ErrorDetail.model_validate(response.json())
