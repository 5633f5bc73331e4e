"""A store outage: 503 with Retry-After where a plan must be read, readiness says so, liveness does not, and a
plan solved meanwhile is still answered (marked not stored). Against a real PostgreSQL server, stopped and
started again; and an SQLite file that cannot be opened."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.core.settings import Settings
from api.core.store import PlanStore, StoreUnavailable, make_engine
from tests.api.support import small_request, verify_plan
from tests.postgres_server import postgres_server


@pytest.fixture(scope="module")
def own_postgres():
    """A server of this module's own: stopping it must not touch the other store tests' server."""
    with postgres_server() as server:
        yield server


def test_a_stopped_database_is_a_503_and_a_plan_solved_meanwhile_is_still_answered(own_postgres):
    url = own_postgres.new_database()
    with TestClient(create_app(Settings(database_url=url, solver_workers=1))) as client:
        kept = client.post("/v1/plan", json=small_request())
        assert kept.status_code == 200 and kept.headers["x-resiplan-stored"] == "true", kept.text
        assert "stored" not in kept.json()
        assert client.get("/readyz").json() == {"status": "ready"}

        own_postgres.stop()
        try:
            for path in (f"/v1/plans/{kept.json()['plan_id']}", f"/v1/plans/{kept.json()['plan_id']}/export/json",
                         "/readyz"):
                down = client.get(path)
                assert down.status_code == 503, (path, down.text)
                assert int(down.headers["retry-after"]) >= 1
                assert "plan store" in down.json()["detail"] and url.split("@")[0] not in down.json()["detail"]
            assert client.get("/healthz").json() == {"status": "ok"}  # alive: only the store is down

            body = small_request(training={"global_batch_size": 16, "seq_length": 2048})
            unstored = client.post("/v1/plan", json=body)
            assert unstored.status_code == 200, unstored.text
            assert unstored.headers["x-resiplan-stored"] == "false" and unstored.json()["stored"] is False
            verify_plan(unstored.json(), body)
        finally:
            own_postgres.start()

        assert client.get("/readyz").json() == {"status": "ready"}
        assert client.get(f"/v1/plans/{kept.json()['plan_id']}").json() == kept.json()
        assert client.get(f"/v1/plans/{unstored.json()['plan_id']}").status_code == 404


def test_a_store_that_cannot_be_opened_lets_the_service_start_but_not_become_ready(tmp_path):
    url = f"sqlite:///{tmp_path}/no-such-dir/plans.db"
    store = PlanStore(make_engine(url))  # does not raise: the table is created on first use
    with pytest.raises(StoreUnavailable, match="could not"):
        store.check()
    with pytest.raises(StoreUnavailable):
        store.get("0123abcd")
    store.close()
    with TestClient(create_app(Settings(database_url=url, solver_workers=1))) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 503
        (tmp_path / "no-such-dir").mkdir()  # the volume is mounted: the store comes up without a restart
        assert client.get("/readyz").status_code == 200
