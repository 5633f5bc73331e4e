"""GET /v1/plans/{id}/schedule.svg and GET /ui/plans/{id}: status codes, content types, what the page shows."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.core.settings import Settings
from render.gantt_zoom_script import GANTT_ZOOM_JS, SCRIPT_CSP_SOURCE
from render.plan_page import featured_replica_id, plan_page_html
from tests.ui.html_support import parse_html
from tests.ui.plans import (
    FAILED,
    SLOW_SPEEDS,
    featured_plan,
    huge_cluster_plan,
    small_plan,
    uneven_microbatches_plan,
)
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
    # One script, the constant zoom script (no plan data in it), and nothing loaded from anywhere.
    scripts = parse_html(html).find_all("script")
    assert [node.text() for node in scripts] == [GANTT_ZOOM_JS] and "src" not in scripts[0].attrs
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
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
    html = plan_page_html(small_plan(), None, SLOW_SPEEDS)
    cluster = parse_svg(inline_svgs(html)[0])
    slow_cells = {r.get("data-device") for r in find_class(cluster, "rect", "slow") if "gpu" in r.get("class")}
    assert slow_cells == set(SLOW_SPEEDS)


def _stage_rows(html):
    return parse_html(html).find("table", "stages").find("tbody").find_all("tr")


def test_stage_table_has_one_row_per_stage_with_the_plans_numbers():
    plan = small_plan()
    rows = _stage_rows(plan_page_html(plan, None, SLOW_SPEEDS))
    assert [(row.attrs["data-replica"], row.attrs["data-stage"]) for row in rows] == [
        ("0", "0"), ("0", "1"), ("0", "2"), ("0", "3"), ("1", "0"), ("1", "1")]
    # Replica 0's stage 1: devices, TP 2, layers [8, 16), 40 GiB of the plan's 80 GiB GPU, 20 / 40 ms at speed 0.5.
    cells = [cell.text() for cell in rows[1].find_all("td")]
    assert cells[:3] == ["1", "0:2-3", "2"]
    assert cells[3].startswith("[8, 16)")
    assert "40.0 / 80 GiB" in cells[4]
    assert cells[5:7] == ["20", "40"]
    assert "×0.5" in cells[7] and "slow" in rows[1].classes()
    assert "slow" not in rows[0].classes()
    microbatch_cells = [cell.text() for row in rows for cell in row.find_all("td", "microbatches")]
    assert microbatch_cells == ["8", "8"]  # one per replica, spanning its stage rows


def test_microbatch_counts_21_22_21_are_in_the_header_and_table():
    html = plan_page_html(uneven_microbatches_plan((21, 22, 21)))
    root = parse_html(html)
    facts = {fact.find("dt").text(): fact.find("dd").text() for fact in root.find_all("div", "fact")}
    assert facts["microbatches"] == "21 / 22 / 21"
    assert facts["GPU memory"] == "80 GiB"
    assert [cell.text() for cell in root.find_all("td", "microbatches")] == ["21", "22", "21"]


def test_many_replicas_alike_share_one_group_of_rows():
    plan = huge_cluster_plan(num_nodes=256)
    html = plan_page_html(plan)
    rows = _stage_rows(html)
    legend = [item.text() for item in parse_html(html).find("ul", "replica-legend").find_all("li")]
    assert legend == [f"replica {replica.id}" for replica in plan.replicas]  # past 8: every one named
    assert len(plan.replicas) == 31
    assert len(rows) == 8  # every replica has the same 8 stages: one group
    replica_cell = rows[0].find("th", "replica").text()
    assert "replicas 0–30" in replica_cell and "devices of replica 0" in replica_cell


def test_memory_without_capacity_says_so():
    plan = small_plan().model_copy(update={"gpu_memory_gib": None})
    html = plan_page_html(plan)
    cells = [row.find("td", "memory-cell").text() for row in _stage_rows(html)]
    assert cells[0] == "40.0 GiB"
    assert "does not record its GPUs' memory capacity" in parse_html(html).text()


def test_chart_defaults_to_the_replica_with_the_slow_gpu():
    plan = featured_plan()
    slowest = max(plan.pipeline_schedule.replicas, key=lambda e: e.makespan_ms)
    assert slowest.replica_ids == [0]  # so the default is not simply the slowest timeline
    assert featured_replica_id(plan, None) == 1
    gantt = parse_svg(inline_svgs(plan_page_html(plan))[1])
    assert "replica 1" in text_of(find_class(gantt, "text", "title")[0])
    # Asked for explicitly, another replica is shown.
    gantt0 = parse_svg(inline_svgs(plan_page_html(plan, 0))[1])
    assert "replica 0" in text_of(find_class(gantt0, "text", "title")[0])


def test_chart_default_without_slow_gpus_is_a_replica_beside_a_failed_gpu_else_the_slowest():
    plan = featured_plan()
    healthy = plan.model_copy(update={"slow_devices": [], "replicas": [
        r.model_copy(update={"stages": [s.model_copy(update={"speed": 1.0}) for s in r.stages]}) for r in plan.replicas]})
    assert featured_replica_id(healthy, None) is None
    beside_failure = healthy.model_copy(update={"excluded_devices": ["1:2"]})
    assert featured_replica_id(beside_failure, None) == 1


def test_link_query_is_on_every_link_back_at_the_service():
    from urllib.parse import parse_qs, urlsplit

    link_query = {"expires": "1700000000", "signature": 'a&b="<c>" d#e'}
    html = plan_page_html(small_plan(), 1, SLOW_SPEEDS, link_query=link_query)
    assert 'signature=a&b' not in html and '"<c>"' not in html  # encoded and escaped, never raw
    hrefs = [node.attrs["href"] for node in parse_html(html).iter() if "href" in node.attrs]
    service_links = [href for href in hrefs if not href.startswith("data:")]
    # plan JSON, schedule.svg, 4 exports, the other timeline in the nav bar and in the table
    assert len(service_links) == 8
    for href in service_links:
        parts = urlsplit(href)
        assert parts.scheme == "" and parts.netloc == "", href
        assert parts.path.startswith("/v1/plans/hand-made") or parts.path == "", href
        query = parse_qs(parts.query, keep_blank_values=True)
        assert query["expires"] == ["1700000000"] and query["signature"] == ['a&b="<c>" d#e'], href
    replica_links = [href for href in service_links if "replica=" in href]
    assert {parse_qs(urlsplit(h).query)["replica"][0] for h in replica_links} == {"0", "1"}
    assert all(urlsplit(h).fragment == "schedule" for h in replica_links if urlsplit(h).path == "")
    assert "/v1/plans/hand-made/schedule.svg?replica=1&amp;expires=1700000000&amp;signature=a%26b%3D" in html


def test_page_without_link_query_has_plain_links():
    hrefs = [node.attrs["href"] for node in parse_html(plan_page_html(small_plan(), 0)).iter() if "href" in node.attrs]
    assert "/v1/plans/hand-made" in hrefs and "?replica=1#schedule" in hrefs
    assert "/v1/plans/hand-made/export/megatron" in hrefs


def test_unreadable_device_ids_leave_the_map_out_not_the_page():
    body = small_plan().model_dump()
    body["replicas"][1]["stages"][1]["devices"] = ["<b>gpu</b>"]
    html = plan_page_html(type(small_plan()).model_validate(body))
    root = parse_html(html)
    assert root.find_all("b") == []
    note = root.find("p", "note").text()
    assert "cluster map cannot be drawn" in note and "<b>gpu</b>" in note
    assert len(root.find_all("table", "stages")) == 1 and len(inline_svgs(html)) == 1  # the Gantt chart still there


def test_script_hash_matches_the_script():
    import base64
    import hashlib

    expected = base64.b64encode(hashlib.sha256(GANTT_ZOOM_JS.encode()).digest()).decode()
    assert SCRIPT_CSP_SOURCE == f"'sha256-{expected}'"
    assert "</script" not in GANTT_ZOOM_JS.lower() and "<!--" not in GANTT_ZOOM_JS


def test_an_expert_parallel_plan_says_so_and_a_dense_one_does_not():
    plan = small_plan()
    assert "Expert parallelism" not in plan_page_html(plan, None, SLOW_SPEEDS)
    tp = plan.replicas[0].stages[0].tp
    html = plan_page_html(plan.model_copy(update={"ep": 2}), None, SLOW_SPEEDS)
    assert "experts split over 2 GPUs of 2 replicas" in html
    html = plan_page_html(plan.model_copy(update={"ep": 2 * tp, "etp": 1}), None, SLOW_SPEEDS)
    assert f"experts split over {2 * tp} GPUs of 2 replicas (whole experts)" in html


def test_a_hybrid_sharded_plan_says_so_and_a_fully_sharded_one_does_not():
    plan = small_plan()
    assert plan.zero_stage >= 1
    for every_replica in (None, len(plan.replicas)):
        html = plan_page_html(plan.model_copy(update={"dp_shard": every_replica}), None, SLOW_SPEEDS)
        assert "Hybrid sharding" not in html
    html = plan_page_html(plan.model_copy(update={"dp_shard": 1}), None, SLOW_SPEEDS)
    assert f"sharded over groups of 1 replicas, {len(plan.replicas)} groups holding the same shards" in html
