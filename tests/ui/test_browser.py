"""The plan page in headless Chromium: it renders, shows every node, marks failed and slow GPUs, lists every
stage with its microbatches and memory, zooms and pans its Gantt chart, fits two window sizes, logs no errors.

Screenshots of both window sizes land in the test's tmp dir (pytest prints it on failure; `--basetemp`
chooses it) for a person to look at.

Needs Debian's chromium (/usr/bin/chromium) and the `playwright` Python package; no browser download.
A missing browser or package fails the test rather than skipping it, so CI cannot go green without it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.api.support import small_request

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
REPO = Path(__file__).resolve().parents[2]
NUM_NODES, GPUS_PER_NODE = 3, 8
FAILED = ["1:7", "2:*"]
SLOW = [{"device": "0:3", "speed": 0.8}]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The real app under uvicorn in a subprocess, on a free loopback port with its own SQLite file."""
    port = _free_port()
    env = {**os.environ, "RESIPLAN_DATABASE_URL": f"sqlite:///{tmp_path_factory.mktemp('ui-db')}/plans.db"}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "api.app:create_app", "--factory", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                output = process.stdout.read().decode(errors="replace") if process.poll() is not None else ""
                pytest.fail(f"uvicorn did not come up on {base}: {output[-2000:]}")
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def browser():
    """A launched Chromium, or why there is none: the test, not the fixture, fails on it (FAILED, not ERROR)."""
    if not Path(CHROMIUM).exists():
        yield f"{CHROMIUM} is missing: apt-get install -y chromium"
        return
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        yield "the playwright package is missing: pip install playwright (no `playwright install` needed)"
        return
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


def _ready(browser):
    if isinstance(browser, str):
        pytest.fail(browser)
    return browser


@pytest.fixture(scope="module")
def stored_plan(server):
    body = small_request(
        cluster={"num_nodes": NUM_NODES, "gpus_per_node": GPUS_PER_NODE, "gpu": "A100-80GB"},
        failures={"failed": FAILED, "slow": SLOW},
    )
    response = httpx.post(f"{server}/v1/plan", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _open(browser, url, viewport=(1500, 1000)):
    """A page at `url` and the list its console errors and uncaught exceptions land in."""
    page = _ready(browser).new_page(viewport={"width": viewport[0], "height": viewport[1]})
    errors: list[str] = []

    def on_console(message) -> None:
        # A bare SVG document has no <link rel="icon">, so Chromium asks for /favicon.ico: not our error.
        if message.type == "error" and not message.location.get("url", "").endswith("/favicon.ico"):
            errors.append(f"console {message.type}: {message.text} at {message.location}")

    page.on("console", on_console)
    page.on("pageerror", lambda error: errors.append(f"pageerror: {error}"))
    response = page.goto(url, wait_until="load")
    return page, response, errors


def _default_timeline(plan):
    """The timeline the page shows unasked: the replica using the slow GPU, else the slowest."""
    entries = plan["pipeline_schedule"]["replicas"]
    holding = {r["id"] for r in plan["replicas"] for s in r["stages"] if SLOW[0]["device"] in s["devices"]}
    return next((e for e in entries if holding & set(e["replica_ids"])),
                max(entries, key=lambda e: e["makespan_ms"]))


def _title_replica_ids(page) -> list[int]:
    """The replica ids the chart's title names: "replica 3" or "replicas 1, 2, 5 …" (at most six)."""
    title = page.locator("svg.gantt text.title").text_content()
    match = re.search(r"· replicas? ([0-9, ]+)", title)
    assert match is not None, title
    return [int(i) for i in match.group(1).replace(" ", "").split(",") if i]


def test_plan_page_renders_every_node_and_mark(server, browser, stored_plan):
    plan = stored_plan
    page, response, errors = _open(browser, f"{server}/ui/plans/{plan['plan_id']}")
    try:
        assert response.status == 200
        assert plan["plan_id"] in page.title()
        header = page.locator("header").inner_text()
        assert plan["model"] in header
        for label in ("STATUS", "ITERATION TIME", "TOKENS / S", "MFU", "SCHEDULE", "BUBBLE"):
            assert label in header.upper(), label

        nodes = page.locator("svg.cluster-map g.node")
        assert nodes.count() == NUM_NODES
        assert page.locator("svg.cluster-map rect.gpu").count() == NUM_NODES * GPUS_PER_NODE
        # Drawn, not just present: every node row has a real box on screen.
        sizes = page.eval_on_selector_all("svg.cluster-map g.node", "gs => gs.map(g => g.getBBox().width)")
        assert len(sizes) == NUM_NODES and min(sizes) > 0

        failed = set(page.eval_on_selector_all("svg.cluster-map rect.gpu.failed", "rs => rs.map(r => r.dataset.device)"))
        assert failed == {"1:7"} | {f"2:{g}" for g in range(GPUS_PER_NODE)}
        assert page.locator("svg.cluster-map path.x").count() == len(failed)
        # The plan names its slow GPUs, so the map marks exactly those, used or not.
        slow_marked = set(page.eval_on_selector_all(
            "svg.cluster-map rect.gpu.slow, svg.cluster-map rect.gpu.slow-stage", "rs => rs.map(r => r.dataset.device)"))
        assert slow_marked == {slow["device"] for slow in SLOW}

        if plan["pipeline_schedule"] is not None:
            rows = page.locator("svg.gantt g.row")
            shown = _default_timeline(plan)
            assert _title_replica_ids(page) == shown["replica_ids"][:6]
            assert rows.count() == len(shown["stages"])
            ops = sum(len(t["ops"]) for t in shown["stages"])
            assert page.locator("svg.gantt g.ops rect").count() == ops
        else:
            assert "no pipeline schedule" in page.content()
        page.wait_for_timeout(200)  # let late console messages arrive
        assert errors == []
    finally:
        page.close()


def test_schedule_svg_opens_as_an_image(server, browser, stored_plan):
    url = f"{server}/v1/plans/{stored_plan['plan_id']}/schedule.svg"
    page, response, errors = _open(browser, url)
    try:
        if stored_plan["pipeline_schedule"] is None:
            assert response.status == 422
            return
        assert response.status == 200
        assert response.headers["content-type"].startswith("image/svg+xml")
        box = page.locator("svg.gantt").bounding_box()
        assert box is not None and box["width"] > 500
        assert errors == []
    finally:
        page.close()


WINDOW_SIZES = [(1500, 900), (800, 1000)]


def _gantt_view_ms(page) -> tuple[float, float]:
    card = page.locator("[data-gantt-zoom]")
    return float(card.get_attribute("data-view-start-ms")), float(card.get_attribute("data-view-end-ms"))


def _op_widths_px(page) -> list[float]:
    """Screen widths of the first stage's first ten ops."""
    return page.eval_on_selector_all(
        "svg.gantt g.row:first-of-type g.ops rect", "rs => rs.slice(0, 10).map(r => r.getBoundingClientRect().width)")


def _tick_labels(page) -> list[str]:
    return page.eval_on_selector_all("svg.gantt g.axis text.tick", "ts => ts.map(t => t.textContent)")


@pytest.mark.parametrize("window", WINDOW_SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
def test_plan_page_fits_the_window_and_lists_every_stage(server, browser, stored_plan, window, tmp_path):
    plan = stored_plan
    page, response, errors = _open(browser, f"{server}/ui/plans/{plan['plan_id']}", viewport=window)
    try:
        assert response.status == 200
        page.screenshot(path=str(tmp_path / f"plan-page-{window[0]}x{window[1]}.png"), full_page=True)
        # Nothing wider than the window, and nothing wider than its card.
        assert page.evaluate("document.documentElement.scrollWidth") <= window[0]
        overflowing = page.eval_on_selector_all(
            ".card", "cs => cs.filter(c => c.scrollWidth > c.clientWidth + 1).map(c => c.className)")
        assert overflowing == []

        counts = [replica["num_microbatches"] for replica in plan["replicas"]]
        facts = dict(zip(page.locator(".fact dt").all_inner_texts(), page.locator(".fact dd").all_inner_texts()))
        assert facts["MICROBATCHES"] == " / ".join(map(str, counts))  # dt is upper-cased by CSS
        rows = page.locator("table.stages tbody tr")
        assert rows.count() == sum(len(replica["stages"]) for replica in plan["replicas"])
        assert page.locator("table.stages td.microbatches").all_inner_texts() == [str(c) for c in counts]
        first_stage = plan["replicas"][0]["stages"][0]
        memory = page.locator("table.stages td.memory-cell").first.inner_text()
        assert memory.startswith(f"{first_stage['memory_gib']:,.1f}")
        if plan.get("gpu_memory_gib") is not None:
            assert f"/ {plan['gpu_memory_gib']:g} GiB" in memory

        if plan["pipeline_schedule"] is not None:
            # The chart is fitted to its card: its drawing is as wide as the card's inside, not scaled down.
            svg_width = page.eval_on_selector("svg.gantt", "s => s.viewBox.baseVal.width")
            box = page.locator("svg.gantt").bounding_box()
            assert box["width"] == pytest.approx(svg_width, abs=1)
            card_box = page.locator(".gantt-card").bounding_box()
            assert box["x"] + box["width"] <= card_box["x"] + card_box["width"]
        page.wait_for_timeout(200)
        assert errors == []
    finally:
        page.close()


def test_gantt_chart_zooms_and_pans(server, browser, stored_plan, tmp_path):
    plan = stored_plan
    if plan["pipeline_schedule"] is None:
        pytest.skip("the planner returned no schedule for this request")
    page, _, errors = _open(browser, f"{server}/ui/plans/{plan['plan_id']}", viewport=(1500, 900))
    try:
        entry = _default_timeline(plan)
        assert _title_replica_ids(page) == entry["replica_ids"][:6]
        makespan_ms = entry["makespan_ms"]
        assert page.locator("[data-gantt-tools]").is_visible()
        start_ms, end_ms = _gantt_view_ms(page)
        assert (start_ms, end_ms) == (0.0, pytest.approx(makespan_ms))
        ticks_before = _tick_labels(page)
        widths_before_px = _op_widths_px(page)

        page.click("[data-gantt-action=in]")
        page.click("[data-gantt-action=in]")
        page.wait_for_timeout(50)
        start_ms, end_ms = _gantt_view_ms(page)
        assert end_ms - start_ms == pytest.approx(makespan_ms / 4)
        assert start_ms == pytest.approx(makespan_ms * 3 / 8)  # zoomed about the centre
        assert _tick_labels(page) != ticks_before
        # On screen, every op is four times as wide as in the whole-iteration view.
        assert _op_widths_px(page) == pytest.approx([4 * w for w in widths_before_px], rel=1e-3)
        assert "4×" in page.locator("[data-gantt-readout]").inner_text()
        # Ops are wider now: more of them carry a label than in the whole-iteration view.
        page.locator(".gantt-card").screenshot(path=str(tmp_path / "gantt-zoomed.png"))

        page.click("[data-gantt-action=right]")
        page.wait_for_timeout(50)
        panned_start_ms, panned_end_ms = _gantt_view_ms(page)
        assert panned_start_ms == pytest.approx(start_ms + makespan_ms / 16)
        assert panned_end_ms - panned_start_ms == pytest.approx(makespan_ms / 4)

        # Ctrl + wheel zooms at the pointer; the view stays inside the iteration.
        page.locator("svg.gantt").scroll_into_view_if_needed()
        box = page.locator("svg.gantt rect.idle").first.bounding_box()  # the plot, unlike the zoomed ops
        page.mouse.move(box["x"] + box["width"] * 0.9, box["y"] + box["height"] / 2)
        page.keyboard.down("Control")
        page.mouse.wheel(0, 400)  # down: out
        page.keyboard.up("Control")
        page.wait_for_timeout(50)
        wheel_start_ms, wheel_end_ms = _gantt_view_ms(page)
        assert wheel_end_ms - wheel_start_ms > panned_end_ms - panned_start_ms
        assert 0 <= wheel_start_ms and wheel_end_ms <= makespan_ms + 1e-6

        page.click("[data-gantt-action=reset]")
        page.wait_for_timeout(50)
        assert _gantt_view_ms(page) == (0.0, pytest.approx(makespan_ms))
        assert _tick_labels(page) == ticks_before
        page.wait_for_timeout(200)
        assert errors == []
    finally:
        page.close()
