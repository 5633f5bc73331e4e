"""The solver pool as clients see it: 503 + Retry-After when saturated, a crash fails only its request,
504 past the deadline backstop. The app's own pool is kept busy with test-only tasks through the
TestClient's event loop (its portal), so saturation is exact rather than timed."""

from __future__ import annotations

import functools
import threading

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.core.settings import Settings
from api.deps import PoolDep
from tests.api import pool_tasks
from tests.api.support import small_request, verify_plan


def _app(tmp_path, **settings):
    return create_app(Settings(database_url=f"sqlite:///{tmp_path}/pool.db", **settings))


def _occupy(client: TestClient, seconds: float):
    """Run a task that holds one worker for `seconds`, on the app's pool in the app's event loop."""
    pool = client.app.state.pool
    return client.portal.start_task_soon(functools.partial(pool.run, pool_tasks.sleep_then, seconds, "held",
                                                           deadline_s=60))


def _wait_busy(client: TestClient, busy: int) -> None:
    pool = client.app.state.pool
    for _ in range(500):
        if pool.stats().busy + pool.stats().queued >= busy:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"pool never had {busy} tasks: {pool.stats()}")


def test_a_saturated_service_answers_503_with_retry_after_then_recovers(tmp_path):
    with TestClient(_app(tmp_path, solver_workers=1, solver_queue_size=1)) as client:
        held = [_occupy(client, 2.0), _occupy(client, 2.0)]  # one solving, one queued: full
        _wait_busy(client, 2)
        for path, body in (("/v1/plan", small_request()), ("/v1/estimate", small_request(layout={"tp": 2, "pp": 2}))):
            response = client.post(path, json=body)
            assert response.status_code == 503, response.text
            assert int(response.headers["Retry-After"]) >= 1
            assert "at capacity" in response.json()["detail"]
            assert "1 solver workers are busy and 1 requests are waiting" in response.json()["detail"]
        assert client.get("/healthz").status_code == 200  # health never queues behind solves
        assert [future.result(timeout=30) for future in held] == ["held", "held"]
        body = small_request()
        response = client.post("/v1/plan", json=body)
        assert response.status_code == 200, response.text
        verify_plan(response.json(), body)


def test_retry_after_is_the_backlog_at_recent_solve_times(tmp_path):
    """Two 7 s tasks ahead on one worker: come back in 14 s, not 1 s."""
    with TestClient(_app(tmp_path, solver_workers=1, solver_queue_size=1)) as client:
        client.app.state.pool.run_times.record("sleep_then", 7.0)  # as if recent ones had taken 7 s
        held = [_occupy(client, 1.0), _occupy(client, 1.0)]
        _wait_busy(client, 2)
        response = client.post("/v1/plan", json=small_request())
        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"] == "14"
        assert "retry in 14 s" in response.json()["detail"]
        assert [future.result(timeout=30) for future in held] == ["held", "held"]


def test_a_worker_crash_fails_only_its_request_and_the_next_one_succeeds(tmp_path):
    app = _app(tmp_path, solver_workers=2, solver_queue_size=0)

    @app.post("/test/crash")
    async def crash(pool: PoolDep) -> None:  # test-only route: a solve whose worker is SIGKILLed
        await pool.run(pool_tasks.kill_self, 0.5, deadline_s=30)

    with TestClient(app) as client:
        body = small_request(failures={"failed": ["0:3"]})
        outcome: dict[str, object] = {}
        planner = threading.Thread(target=lambda: outcome.setdefault("plan", client.post("/v1/plan", json=body)))
        planner.start()
        crashed = client.post("/test/crash")
        planner.join(timeout=60)
        assert crashed.status_code == 503, crashed.text
        assert int(crashed.headers["Retry-After"]) >= 1
        assert "stopped unexpectedly (killed by SIGKILL)" in crashed.json()["detail"]
        # The plan solving beside it on the other worker was not affected.
        assert outcome["plan"].status_code == 200, outcome["plan"].text
        verify_plan(outcome["plan"].json(), body)
        # The dead worker has been replaced: both workers serve again.
        after = client.post("/v1/plan", json=small_request())
        assert after.status_code == 200, after.text
        assert len(client.app.state.pool.worker_pids()) == 2


def test_a_task_past_deadline_and_grace_is_answered_504(tmp_path):
    app = _app(tmp_path, solver_workers=1, solver_queue_size=0, solver_grace_s=0.3)

    @app.post("/test/stuck")
    async def stuck(pool: PoolDep) -> None:  # test-only route: a solve that ignores its time limit
        await pool.run(pool_tasks.sleep_then, 60.0, None, deadline_s=0.2)

    with TestClient(app) as client:
        response = client.post("/test/stuck")
        assert response.status_code == 504, response.text
        assert "deadline" in response.json()["detail"]
        assert client.post("/v1/plan", json=small_request()).status_code == 200


@pytest.mark.parametrize("path", ["/v1/plan", "/v1/estimate"])
def test_solves_run_in_worker_processes_not_the_server(tmp_path, path, monkeypatch):
    """Patching the planner in the server process changes nothing: the solve happens elsewhere."""
    import api.tasks.planning

    def broken(*_args, **_kwargs):
        raise AssertionError("solved in the server process")

    monkeypatch.setattr(api.tasks.planning, "plan_for", broken)
    monkeypatch.setattr(api.tasks.planning, "estimate_for", broken)
    body = small_request(layout={"tp": 2, "pp": 2}) if path == "/v1/estimate" else small_request()
    with TestClient(_app(tmp_path, solver_workers=1)) as client:
        response = client.post(path, json=body)
    assert response.status_code == 200, response.text
