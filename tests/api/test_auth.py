"""RESIPLAN_API_TOKEN: every /v1 route, POST /plan and the plan page need `Authorization: Bearer <token>` or
(read-only views of one plan) a signed view link; /healthz, /readyz, /metrics and /docs stay open."""

from __future__ import annotations

import html
import re
import time

import pytest
from fastapi.testclient import TestClient

from adapters.client import PlannerClient, PlannerError
from api.app import create_app
from api.core.auth import ViewLinks
from api.core.settings import Settings
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
    ("POST", "/v1/plans/0123/view-link"),
    ("GET", "/v1/no-such-route"),
    ("POST", "/plan"),
    ("GET", "/ui/plans/0123"),
    ("GET", "/ui/no-such-page"),
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


def test_health_metrics_and_docs_stay_open_and_reveal_no_plan(guarded):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    created = guarded.post("/v1/plan", json=small_request(model="llama3-8b"), headers=headers)
    assert created.status_code == 200, created.text
    plan_id = created.json()["plan_id"]
    assert guarded.get(f"/ui/plans/{plan_id}", headers=headers).status_code == 200
    assert guarded.get("/healthz").json() == {"status": "ok"}
    assert guarded.get("/readyz").json() == {"status": "ready"}
    assert guarded.get("/docs").status_code == 200
    assert guarded.get("/openapi.json").status_code == 200
    metrics = guarded.get("/metrics")
    assert metrics.status_code == 200
    # Route templates and counts only: no plan id, no model, no device.
    assert plan_id not in metrics.text and "llama3-8b" not in metrics.text and '"0:0"' not in metrics.text


def _view_link(guarded, plan_id: str, **body) -> dict:
    response = guarded.post(f"/v1/plans/{plan_id}/view-link", json=body or None,
                            headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def two_plans(guarded) -> tuple[str, str]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    ids = []
    for batch in (32, 16):
        created = guarded.post("/v1/plan", json=small_request(training={"global_batch_size": batch, "seq_length": 2048}),
                               headers=headers)
        assert created.status_code == 200, created.text
        ids.append(created.json()["plan_id"])
    return ids[0], ids[1]


def test_a_view_link_opens_the_page_and_the_pages_own_links(guarded, two_plans):
    plan_id, _ = two_plans
    link = _view_link(guarded, plan_id)
    assert link["signed"] is True and link["url"].startswith(f"/ui/plans/{plan_id}?expires=")
    page = guarded.get(link["url"])  # no Authorization header: a browser following the link
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    hrefs = [href for href in re.findall(r'href="([^"]+)"', page.text) if href.startswith(("/", "?"))]
    assert hrefs, "the page links to the plan's other views"
    for href in hrefs:
        url = html.unescape(href)
        if url.startswith("?"):
            url = f"/ui/plans/{plan_id}{url}"
        assert "signature=" in url, url
        followed = guarded.get(url.split("#")[0])
        assert followed.status_code == 200, (url, followed.text[:200])
    assert guarded.get(link["plan_json_url"]).json()["plan_id"] == plan_id
    assert guarded.get(link["schedule_svg_url"]).headers["content-type"].startswith("image/svg+xml")


def test_the_page_opened_with_the_token_signs_its_links(guarded, two_plans):
    plan_id, _ = two_plans
    page = guarded.get(f"/ui/plans/{plan_id}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert page.status_code == 200
    svg_href = html.unescape(re.search(r'href="(/v1/plans/[^"]+/schedule\.svg[^"]*)"', page.text).group(1))
    assert guarded.get(svg_href).status_code == 200  # followed without the header, as a browser would


def test_a_view_link_opens_nothing_else(guarded, two_plans):
    plan_id, other_id = two_plans
    link = _view_link(guarded, plan_id)
    query = link["url"].split("?", 1)[1]
    assert guarded.get(f"/ui/plans/{other_id}?{query}").status_code == 401  # another plan
    assert guarded.post(f"/v1/plans/{plan_id}/replan?{query}", json={}).status_code == 401  # not a read
    assert guarded.post(f"/v1/plans/{plan_id}/view-link?{query}").status_code == 401  # cannot mint links
    assert guarded.post(f"/v1/plan?{query}", json=small_request()).status_code == 401
    tampered = query.replace("signature=", "signature=0")
    assert guarded.get(f"/ui/plans/{plan_id}?{tampered}").status_code == 401
    expires = int(query.split("expires=")[1].split("&")[0])
    later = query.replace(f"expires={expires}", f"expires={expires + 3600}")  # extending the link breaks it
    assert guarded.get(f"/ui/plans/{plan_id}?{later}").status_code == 401


def test_an_expired_view_link_is_refused(guarded, two_plans, monkeypatch):
    plan_id, _ = two_plans
    link = _view_link(guarded, plan_id, ttl_s=10)
    assert guarded.get(link["url"]).status_code == 200
    import api.core.auth

    monkeypatch.setattr(api.core.auth.time, "time", lambda: link["expires_unix_s"] + 1)
    assert guarded.get(link["url"]).status_code == 401


def test_a_view_link_of_another_token_is_refused(guarded, two_plans):
    plan_id, _ = two_plans
    expires = int(time.time()) + 600
    forged = ViewLinks.for_token("not-the-token").query(plan_id, expires)
    assert guarded.get(f"/ui/plans/{plan_id}", params=forged).status_code == 401
    genuine = ViewLinks.for_token(TOKEN).query(plan_id, expires)
    assert guarded.get(f"/ui/plans/{plan_id}", params=genuine).status_code == 200


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
