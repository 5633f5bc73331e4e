"""Solving never blocks the event loop: /healthz answers while a plan is being solved.

Ordering, not timing: the planner is held on an event until the health check
has answered, against a real uvicorn server on loopback.
"""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
import uvicorn

import api.service
from api.app import create_app
from api.settings import Settings
from tests.api.support import small_request


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    port = _free_port()
    config = uvicorn.Config(create_app(Settings(database_url=f"sqlite:///{tmp_path}/loop.db")),
                            host="127.0.0.1", port=port, log_level="warning")
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    for _ in range(200):
        if instance.started:
            break
        threading.Event().wait(0.05)
    assert instance.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    instance.should_exit = True
    thread.join(timeout=10)


def test_health_check_answers_while_a_plan_is_solving(server, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real_plan = api.service.plan

    def held_plan(problem):
        entered.set()
        assert release.wait(timeout=30), "test never released the planner"
        return real_plan(problem)

    monkeypatch.setattr(api.service, "plan", held_plan)
    result: dict[str, httpx.Response] = {}

    def post_plan():
        result["plan"] = httpx.post(f"{server}/v1/plan", json=small_request(), timeout=60)

    poster = threading.Thread(target=post_plan)
    poster.start()
    try:
        assert entered.wait(timeout=30), "plan request never reached the planner"
        health = httpx.get(f"{server}/healthz", timeout=10)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert "plan" not in result, "plan finished before the health check; the test proves nothing"
    finally:
        release.set()
        poster.join(timeout=60)
    assert result["plan"].status_code == 200
