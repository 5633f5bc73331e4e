"""RESIPLAN_API_TOKEN: every /v1 route needs `Authorization: Bearer <token>`; /healthz stays open."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from adapters.client import PlannerClient, PlannerError
from api.app import create_app
from api.settings import Settings
from tests.api.support import small_request

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RESIPLAN_API_TOKEN", TOKEN)  # read from the environment, as in production
        settings = Settings(database_url=f"sqlite:///{tmp_path_factory.mktemp('auth')}/auth.db", solver_workers=1)
    with TestClient(create_app(settings)) as client:
        yield client


V1_CALLS = [
    ("POST", "/v1/plan"),
    ("POST", "/v1/estimate"),
    ("POST", "/v1/detect"),
    ("GET", "/v1/plans/0123"),
    ("GET", "/v1/plans/0123/export/json"),
    ("GET", "/v1/plans/0123/schedule.svg"),
    ("POST", "/v1/plans/0123/replan"),
    ("GET", "/v1/no-such-route"),
]


@pytest.mark.parametrize(("method", "path"), V1_CALLS)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token", f"Basic {TOKEN}", "Bearer", f"bearer {TOKEN}x"])
def test_every_v1_route_refuses_a_missing_or_wrong_token(guarded, method, path, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    response = guarded.request(method, path, json={}, headers=headers)
    assert response.status_code == 401, response.text
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    detail = response.json()["detail"]
    assert ("Authorization: Bearer <token>" in detail) if authorization in (None, "Bearer", f"Basic {TOKEN}") \
        else detail == "the bearer token is not valid for this service"


def test_the_right_token_is_let_through(guarded):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    created = guarded.post("/v1/plan", json=small_request(), headers=headers)
    assert created.status_code == 200, created.text
    plan_id = created.json()["plan_id"]
    assert guarded.get(f"/v1/plans/{plan_id}", headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200
    assert guarded.get("/v1/plans/unknown", headers=headers).status_code == 404  # past auth, to the route


def test_health_metrics_and_docs_stay_open(guarded):
    assert guarded.get("/healthz").json() == {"status": "ok"}
    assert guarded.get("/metrics").status_code == 200
    assert guarded.get("/openapi.json").status_code == 200


def test_the_client_sends_its_token(guarded):
    with PlannerClient("http://testserver", TOKEN, http=guarded, retries=0) as client:
        plan = client.plan(small_request())
        assert client.get(plan.plan_id).plan_id == plan.plan_id
    with PlannerClient("http://testserver", "wrong", http=guarded, retries=0) as client, \
            pytest.raises(PlannerError) as refused:
        client.get(plan.plan_id)
    assert refused.value.status_code == 401


@pytest.mark.parametrize("token", [None, ""])
def test_no_token_means_no_auth(tmp_path, monkeypatch, token):
    if token is None:
        monkeypatch.delenv("RESIPLAN_API_TOKEN", raising=False)
    else:
        monkeypatch.setenv("RESIPLAN_API_TOKEN", token)
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path}/open.db", solver_workers=1))) as client:
        assert client.get("/v1/plans/unknown").status_code == 404
