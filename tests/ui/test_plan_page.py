"""GET /v1/plans/{id}/schedule.svg and GET /ui/plans/{id}: status codes, content types, what the page shows."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from tests.ui.plans import FAILED, SLOW_SPEEDS, small_plan
from tests.ui.svg_support import find_class, inline_svgs, parse_svg, text_of


@pytest.fixture
def client(tmp_path):
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path}/ui.db")),
                    raise_server_exceptions=False) as test_client:
        yield test_client


def _store(client, plan, plan_id):
    stored = plan.model_copy(update={"plan_id": plan_id})
    client.app.state.store.save(plan_id, {}, stored.model_dump(mode="json"))
    return stored


def test_schedule_svg(client):
    plan = _store(client, small_plan(), "with-schedule")
    response = client.get("/v1/plans/with-schedule/schedule.svg")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("image/svg+xml")
    root = parse_svg(response.text)
    slowest = max(plan.pipeline_schedule.replicas, key=lambda e: e.makespan_ms)
    assert len(find_class(root, "g", "row")) == len(slowest.stages)
    replica0 = client.get("/v1/plans/with-schedule/schedule.svg", params={"replica": 0})
    assert replica0.status_code == 200
    assert len(find_class(parse_svg(replica0.text), "g", "row")) == 4


def test_schedule_svg_errors(client):
    _store(client, small_plan(), "with-schedule")
    _store(client, small_plan(with_schedule=False), "no-schedule")
    assert client.get("/v1/plans/unknown/schedule.svg").status_code == 404
    missing = client.get("/v1/plans/no-schedule/schedule.svg")
    assert missing.status_code == 422
    assert "pipeline_schedule" in missing.json()["detail"]
    bad_replica = client.get("/v1/plans/with-schedule/schedule.svg", params={"replica": 7})
    assert bad_replica.status_code == 422
    assert "no replica 7" in bad_replica.json()["detail"]
    assert client.get("/v1/plans/with-schedule/schedule.svg", params={"replica": "x"}).status_code == 422


def test_export_route_serves_the_same_svg(client):
    _store(client, small_plan(), "with-schedule")
    exported = client.get("/v1/plans/with-schedule/export/svg")
    assert exported.status_code == 200
    assert exported.text == client.get("/v1/plans/with-schedule/schedule.svg").text


def test_plan_page(client):
    _store(client, small_plan(), "page")
    response = client.get("/ui/plans/page")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    for fact in ("optimal", "1.234 s", "56,789", "43.2 %", "1f1b", "bubble"):
        assert fact in html, fact
    assert "llama2-7b &lt;test &amp; &quot;quotes&quot;&gt;" in html  # escaped once, not twice
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    cluster, gantt = (parse_svg(svg) for svg in inline_svgs(html))
    assert "cluster-map" in cluster.get("class") and "gantt" in gantt.get("class")
    assert html.index('class="cluster-map"') < html.index('class="gantt"')  # map above the chart
    assert len(find_class(cluster, "g", "node")) == 3
    assert {r.get("data-device") for r in find_class(cluster, "rect", "failed")} == set(FAILED)
    assert "F forward" in text_of(find_class(gantt, "g", "legend")[0])
    assert "hue = replica" in html  # the page's own short legend


def test_plan_page_replica_choice_and_links(client):
    _store(client, small_plan(), "page")
    html = client.get("/ui/plans/page", params={"replica": 0}).text
    gantt = parse_svg(inline_svgs(html)[1])
    assert "replica 0" in text_of(find_class(gantt, "text", "title")[0])
    assert 'href="?replica=1#schedule"' in html
    assert client.get("/ui/plans/page", params={"replica": 9}).status_code == 422


def test_plan_page_without_schedule_still_renders(client):
    _store(client, small_plan(with_schedule=False), "old")
    response = client.get("/ui/plans/old")
    assert response.status_code == 200
    assert "no pipeline schedule" in response.text
    assert len(inline_svgs(response.text)) == 1


def test_plan_page_unknown_plan_is_404_html(client):
    response = client.get("/ui/plans/nope")
    assert response.status_code == 404
    assert response.headers["content-type"].startswith("text/html")
    assert "nope" in response.text


def test_slow_marks_from_request_speeds():
    """The page passes request-side speeds through to the map when a caller has them."""
    from adapters.plan_page import plan_page_html

    html = plan_page_html(small_plan(), None, SLOW_SPEEDS)
    cluster = parse_svg(inline_svgs(html)[0])
    slow_cells = {r.get("data-device") for r in find_class(cluster, "rect", "slow") if "gpu" in r.get("class")}
    assert slow_cells == set(SLOW_SPEEDS)
