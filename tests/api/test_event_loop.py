"""Solving never blocks the event loop: /healthz answers while plans are being solved, against a real
uvicorn server on loopback.

Ordering, not timing: the health check is sent once a solve is known to be running (the pool's busy gauge
on /metrics) and must be answered while that solve is still running. How fast it answers under load is
measured by benchmarks/load.py, not asserted here.
"""

from __future__ import annotations

import json
import threading
import time

import httpx

from api.app import create_app
from api.core.settings import Settings
from tests.api.support import EXAMPLES_DIR, small_request
from tests.live_server import live_server

# A search that takes seconds (3.6 s to prove optimal here): time enough to look at the server meanwhile.
SLOW_BODY = json.loads((EXAMPLES_DIR / "mixed-256xa100-qwen2.5-32b.json").read_text()) | {"options": {"time_limit_s": 3}}


def _gauge(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on /metrics")


def _wait_for_gauge(base_url: str, name: str, value: float) -> None:
    deadline = time.monotonic() + 30
    while _gauge(base_url, name) < value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def test_health_check_answers_while_a_plan_is_solving(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path}/loop.db", solver_workers=1)
    with live_server(create_app(settings)) as base_url:
        result: dict[str, httpx.Response] = {}
        poster = threading.Thread(
            target=lambda: result.setdefault("plan", httpx.post(f"{base_url}/v1/plan", json=SLOW_BODY, timeout=60)))
        poster.start()
        try:
            _wait_for_gauge(base_url, "resiplan_solver_workers_busy", 1)
            health = httpx.get(f"{base_url}/healthz", timeout=10)
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            assert "plan" not in result, "plan finished before the health check; the test proves nothing"
            assert _gauge(base_url, "resiplan_solver_workers_busy") == 1, "the solve ended before the check"
        finally:
            poster.join(timeout=60)
        assert result["plan"].status_code == 200, result["plan"].text


def test_a_full_pool_answers_503_over_http_while_health_stays_quick(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path}/full.db", solver_workers=1, solver_queue_size=0)
    with live_server(create_app(settings)) as base_url:
        result: dict[str, httpx.Response] = {}
        poster = threading.Thread(
            target=lambda: result.setdefault("plan", httpx.post(f"{base_url}/v1/plan", json=SLOW_BODY, timeout=60)))
        poster.start()
        try:
            _wait_for_gauge(base_url, "resiplan_solver_workers_busy", 1)
            rejected = httpx.post(f"{base_url}/v1/plan", json=small_request(), timeout=10)
            assert rejected.status_code == 503, rejected.text
            assert int(rejected.headers["retry-after"]) >= 1
            assert httpx.get(f"{base_url}/healthz", timeout=10).status_code == 200
            # Refused while the first solve still runs: the refusal did not wait for a worker.
            assert "plan" not in result and _gauge(base_url, "resiplan_solver_workers_busy") == 1
        finally:
            poster.join(timeout=60)
        assert result["plan"].status_code == 200, result["plan"].text
