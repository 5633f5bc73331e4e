"""Request limits: body size per route (413), JSON nesting, cluster size, list lengths, sequence length,
batch size (422); each with a `detail` that says what was too big and what is allowed."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.core.limits import nested_deeper_than
from api.core.settings import Settings
from tests.api.support import assert_validation, small_request
from wire.schemas import MAX_CLUSTER_GPUS, PlanRequest


def _padded(size_bytes: int) -> bytes:
    """A valid plan request of exactly `size_bytes` (JSON allows trailing whitespace)."""
    raw = json.dumps(small_request()).encode()
    return raw + b" " * (size_bytes - len(raw))


@pytest.fixture
def small_limits(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path}/limits.db", max_body_bytes=4096,
                        max_detect_body_bytes=16384, max_json_depth=8, solver_workers=1)
    with TestClient(create_app(settings)) as client:
        yield client


def test_a_body_over_the_routes_limit_is_413_before_parsing(small_limits):
    response = small_limits.post("/v1/plan", content=_padded(4097), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["detail"] == "the request body is 4,097 bytes; /v1/plan accepts at most 4,096 bytes"
    # The limit is per route: the same body is small enough for /v1/detect (and then just not a DetectRequest).
    detect = small_limits.post("/v1/detect", content=_padded(4097), headers={"content-type": "application/json"})
    assert detect.status_code == 422, detect.text


def test_a_streamed_body_without_content_length_is_counted(small_limits):
    raw = _padded(5000)

    def chunks():
        for start in range(0, len(raw), 1000):
            yield raw[start : start + 1000]

    response = small_limits.post("/v1/estimate", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["detail"] == "the request body exceeds 4,096 bytes, the most /v1/estimate accepts"


def test_a_body_at_the_limit_is_accepted(small_limits):
    raw = _padded(4096)
    response = small_limits.post("/v1/plan", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


def test_default_limits_fit_a_large_failure_list_but_not_a_bulk_upload(tmp_path):
    every_gpu_failed = small_request(failures={"failed": [f"{node}:{gpu}" for node in range(16_384) for gpu in range(8)]})
    raw = json.dumps(every_gpu_failed).encode()
    settings = Settings(database_url=f"sqlite:///{tmp_path}/d.db", solver_workers=1)
    assert len(raw) <= settings.max_body_bytes, "every GPU of the largest cluster listed as failed must fit"
    with TestClient(create_app(settings)) as client:
        response = client.post("/v1/plan", content=b" " * (settings.max_body_bytes + 1))
    assert response.status_code == 413


def test_json_nested_too_deep_is_422_before_parsing(small_limits):
    deep: dict = {}
    cursor = deep
    for _ in range(10):
        cursor["a"] = {}
        cursor = cursor["a"]
    response = small_limits.post("/v1/plan", json=small_request(model={"hf_config": deep}))
    assert response.status_code == 422
    assert "more than 8 levels deep" in response.json()["detail"]
    # Brackets inside strings are not nesting.
    shallow = small_request(failures={"failed": ["[[[[[[[[[[[[[[[[[[[["]})
    response = small_limits.post("/v1/plan", json=shallow)
    assert response.status_code == 422
    assert "levels deep" not in json.dumps(response.json()), "a string's brackets counted as nesting"


def test_pathological_nesting_is_a_clean_422_on_every_route(tmp_path):
    body = b'{"plan_id": "x", "telemetry": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path}/n.db", solver_workers=1))) as client:
        for path in ("/v1/plan", "/v1/estimate", "/v1/detect"):
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            assert response.status_code == 422, (path, response.text[:300])
            assert len(response.content) < 2000, "the body came back in its own error"


def test_nesting_counter():
    assert not nested_deeper_than(b'{"a": [1, {"b": "[[[[["}]}', 3)
    assert nested_deeper_than(b'{"a": [1, {"b": []}]}', 3)
    assert not nested_deeper_than(b'{"s": "x\\"[[[[["}', 1)
    assert nested_deeper_than(b"[" * 40 + b"]" * 40, 32)
    assert not nested_deeper_than(b"[]" * 1000, 1)
    assert nested_deeper_than(b"[[]" * 40 + b"]" * 40, 32)
    assert not nested_deeper_than(b"[[]" * 31 + b"]" * 31, 32)  # 31 levels, and a leaf pair at the 32nd


def test_cluster_size_is_capped(client):
    too_big = small_request(cluster={"num_nodes": 16_384, "gpus_per_node": 72, "gpu": "A100-80GB"})
    error = assert_validation(client.post("/v1/plan", json=too_big), ("cluster",), "1,179,648 GPUs")
    assert f"at most {MAX_CLUSTER_GPUS:,}" in error["message"]
    largest = small_request(cluster={"num_nodes": 16_384, "gpus_per_node": 8, "gpu": "A100-80GB"})
    PlanRequest.model_validate(largest)  # exactly the cap is accepted


def test_list_lengths_are_capped(client):
    too_many = small_request(failures={"failed": ["0:0"] * 131_073})
    assert_validation(client.post("/v1/plan", json=too_many), ("failures", "failed"), "at most 131072 items")
    schedules = small_request(options={"schedules": ["1f1b"] * 17})
    assert_validation(client.post("/v1/plan", json=schedules), ("options", "schedules"), "at most 16 items")


def test_device_ids_are_length_capped(client):
    """An id of thousands of digits would fail int() inside the planner (a 500) if it got that far."""
    huge = "1" * 5000 + ":0"
    for failures, loc in (({"failed": [huge]}, ("failures", "failed")), ({"slow": [{"device": huge, "speed": 0.5}]},
                                                                         ("failures", "slow"))):
        assert_validation(client.post("/v1/plan", json=small_request(failures=failures)), (*loc,),
                          "at most 24 characters")


def test_sequence_length_and_batch_size_are_capped(client):
    assert_validation(client.post("/v1/plan", json=small_request(training={"global_batch_size": 32, "seq_length": 2**21})),
                      ("training", "seq_length"), "less than or equal to 1048576")
    assert_validation(client.post("/v1/plan", json=small_request(training={"global_batch_size": 65_537, "seq_length": 8})),
                      ("training", "global_batch_size"), "less than or equal to 65536")
    # Each within its own cap, together 68 billion tokens per iteration: the planner would run for minutes.
    both = small_request(training={"global_batch_size": 65_536, "seq_length": 1_048_576})
    assert_validation(client.post("/v1/plan", json=both), ("training",), "68,719,476,736 tokens",
                      "at most 2,147,483,648")


def test_detect_takes_4096_devices_x_8_iterations_and_parses_them_off_the_event_loop(tmp_path):
    """The /v1/detect limit is sized for a large job's telemetry (~24 MB here) while /v1/plan's stays small;
    parsing that much JSON takes seconds, in a worker: /healthz answers meanwhile."""
    import threading
    import time

    from benchmarks.telemetry import (
        Slowdown,
        TelemetryConfig,
        generate_telemetry,
        to_wire,
    )
    from wire.convert import resolve_model
    from wire.schemas import Plan

    settings = Settings(database_url=f"sqlite:///{tmp_path}/big.db", solver_workers=1)
    with TestClient(create_app(settings)) as client:
        layout = {"tp": 8, "pp": 4, "micro_batch_size": 1}
        created = client.post("/v1/estimate", json={
            "cluster": {"num_nodes": 512, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": "llama3-70b",
            "training": {"global_batch_size": 1024, "seq_length": 8192}, "layout": layout})
        assert created.status_code == 200, created.text
        plan = Plan.model_validate(created.json())
        slow_device = plan.replicas[5].stages[1].devices[3]
        windows = generate_telemetry(plan, resolve_model(plan.architecture),
                                     TelemetryConfig(iterations=8, slowdowns=(Slowdown(slow_device, 0.5, 0),)))
        telemetry = [item for window in windows for item in to_wire(window)]
        assert len({item["device"] for item in telemetry}) == 4096 and len(telemetry) == 4096 * 8
        body = json.dumps({"plan_id": plan.plan_id, "telemetry": telemetry}).encode()
        assert settings.max_body_bytes < len(body) <= settings.max_detect_body_bytes

        assert client.post("/v1/plan", content=body).status_code == 413
        outcome: dict = {}
        poster = threading.Thread(target=lambda: outcome.setdefault("detect", client.post("/v1/detect", content=body)))
        poster.start()
        answered_while_detecting = 0
        while poster.is_alive():
            busy_before = _busy_workers(client)
            assert client.get("/healthz").status_code == 200
            answered_while_detecting += busy_before == 1 and _busy_workers(client) == 1
            time.sleep(0.02)
        poster.join()
        # Parsing and detecting take seconds, in a worker process: health checks are answered meanwhile
        # (ordering, not a duration: the worker was busy before and after the answer).
        assert answered_while_detecting >= 1, "no health check was answered while the worker ran the detect"
        response = outcome["detect"]
        assert response.status_code == 200, response.text[:500]
        assert [slow["device"] for slow in response.json()["fail_slow"]] == [slow_device]


def _busy_workers(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("resiplan_solver_workers_busy "):
            return float(line.split()[1])
    raise AssertionError("resiplan_solver_workers_busy not on /metrics")
