"""/metrics in Prometheus format, JSON log lines carrying a request id, X-Request-ID on every answer."""

from __future__ import annotations

import io
import json
import logging

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.core.logs import json_handler
from api.core.settings import Settings
from tests.api.support import small_request

FAMILIES = {
    "resiplan_http_requests": "counter",
    "resiplan_http_request_duration_seconds": "histogram",
    "resiplan_http_requests_in_progress": "gauge",
    "resiplan_solve_duration_seconds": "histogram",
    "resiplan_solve_queue_wait_seconds": "histogram",
    "resiplan_solver_tasks": "counter",
    "resiplan_solver_status": "counter",
    "resiplan_solver_queue_depth": "gauge",
    "resiplan_solver_workers_busy": "gauge",
    "resiplan_solver_workers": "gauge",
    "resiplan_solver_capacity": "gauge",
}


def scrape(client) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def families(client) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(client.get("/metrics").text)}


@pytest.fixture
def observed(tmp_path):
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path}/obs.db", solver_workers=2))) as client:
        yield client


def test_metrics_expose_the_named_families(observed):
    observed.get("/healthz")
    found = families(observed)
    for name, kind in FAMILIES.items():
        assert found.get(name) == kind, f"{name}: {found.get(name)}"


def test_counters_move_with_requests(observed):
    before = scrape(observed)
    body = small_request()
    assert observed.post("/v1/plan", json=body).status_code == 200
    assert observed.post("/v1/plan", json=small_request(model="no-such-model")).status_code == 422
    assert observed.get("/v1/plans/abc").status_code == 404
    after = scrape(observed)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("resiplan_http_requests_total", method="POST", route="/v1/plan", status="200") == 1
    assert delta("resiplan_http_requests_total", method="POST", route="/v1/plan", status="422") == 1
    # By route template, not by plan id: ids would make the label space unbounded.
    assert delta("resiplan_http_requests_total", method="GET", route="/v1/plans/{plan_id}", status="404") == 1
    assert delta("resiplan_http_request_duration_seconds_count", method="POST", route="/v1/plan") == 2
    assert delta("resiplan_solver_tasks_total", task="plan_answer", outcome="ok") == 1
    assert delta("resiplan_solver_tasks_total", task="plan_answer", outcome="error") == 1  # the unknown model
    assert delta("resiplan_solve_duration_seconds_count", task="plan_answer") == 2
    assert delta("resiplan_solve_duration_seconds_sum", task="plan_answer") > 0
    statuses = {key[1][0][1]: after[key] for key in after if key[0] == "resiplan_solver_status_total"}
    assert sum(statuses.values()) == 1 and set(statuses) <= {"OPTIMAL", "FEASIBLE"}
    assert after[("resiplan_solver_workers", ())] == 2
    assert after[("resiplan_solver_capacity", ())] == 4
    assert after[("resiplan_solver_queue_depth", ())] == 0


def test_rejections_by_middleware_are_counted_by_route(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path}/rej.db", solver_workers=1, max_body_bytes=1024)
    with TestClient(create_app(settings)) as client:
        assert client.post("/v1/plan", content=b" " * 2048).status_code == 413
        samples = scrape(client)
    assert samples[("resiplan_http_requests_total", (("method", "POST"), ("route", "/v1/plan"), ("status", "413")))] == 1


def test_every_answer_carries_a_request_id_and_the_log_line_has_it(observed):
    stream = io.StringIO()
    handler = json_handler(stream)
    logger = logging.getLogger("resiplan")
    logger.addHandler(handler)
    try:
        fresh = observed.get("/v1/plans/nope")
        given = observed.get("/healthz", headers={"X-Request-ID": "job-42.retry-1"})
        hostile = observed.get("/healthz", headers={"X-Request-ID": "bad id\twith spaces" + "x" * 200})
    finally:
        logger.removeHandler(handler)
    assert len(fresh.headers["X-Request-ID"]) == 32
    assert given.headers["X-Request-ID"] == "job-42.retry-1"  # a caller's id is kept, to follow it across services
    assert hostile.headers["X-Request-ID"] != "bad id\twith spaces" + "x" * 200
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]  # every line is one JSON object
    requests = [line for line in lines if line.get("event") == "request"]
    assert [line["request_id"] for line in requests] == [
        fresh.headers["X-Request-ID"], "job-42.retry-1", hostile.headers["X-Request-ID"]]
    first = requests[0]
    assert first["status"] == 404 and first["route"] == "/v1/plans/{plan_id}" and first["path"] == "/v1/plans/nope"
    assert first["level"] == "info" and first["logger"] == "resiplan.http" and first["duration_ms"] >= 0
    assert "ts" in first


def test_an_unhandled_error_is_a_json_500_logged_with_its_request_id(tmp_path):
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path}/err.db", solver_workers=1))

    @app.get("/test/boom")
    async def boom() -> None:  # test-only route: a bug
        raise RuntimeError("kaboom")

    stream = io.StringIO()
    handler = json_handler(stream)
    logging.getLogger("resiplan").addHandler(handler)
    try:
        with TestClient(app) as client:
            response = client.get("/test/boom")
    finally:
        logging.getLogger("resiplan").removeHandler(handler)
    request_id = response.headers["X-Request-ID"]
    assert response.status_code == 500
    assert response.json() == {"detail": f"internal server error; request id {request_id}"}
    errors = [json.loads(line) for line in stream.getvalue().splitlines() if '"level": "error"' in line]
    assert errors and errors[0]["request_id"] == request_id and "kaboom" in errors[0]["exception"]


def test_the_json_handler_is_installed_once(tmp_path):
    for _ in range(3):
        create_app(Settings(database_url=f"sqlite:///{tmp_path}/once.db"))
    marked = [h for h in logging.getLogger("resiplan").handlers if getattr(h, "_resiplan_json", False)]
    assert len(marked) == 1
