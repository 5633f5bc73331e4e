"""The plan page in headless Chromium: it renders, shows every node, marks failed and slow GPUs, logs no errors.

Needs Debian's chromium (/usr/bin/chromium) and the `playwright` Python package; no browser download.
A missing browser or package fails the test rather than skipping it, so CI cannot go green without it.
"""

from __future__ import annotations

import os
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


def _open(browser, url):
    """A page at `url` and the list its console errors and uncaught exceptions land in."""
    page = _ready(browser).new_page(viewport={"width": 1500, "height": 1000})
    errors: list[str] = []

    def on_console(message) -> None:
        # A bare SVG document has no <link rel="icon">, so Chromium asks for /favicon.ico: not our error.
        if message.type == "error" and not message.location.get("url", "").endswith("/favicon.ico"):
            errors.append(f"console {message.type}: {message.text} at {message.location}")

    page.on("console", on_console)
    page.on("pageerror", lambda error: errors.append(f"pageerror: {error}"))
    response = page.goto(url, wait_until="load")
    return page, response, errors


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
            slowest = max(plan["pipeline_schedule"]["replicas"], key=lambda e: e["makespan_ms"])
            assert rows.count() == len(slowest["stages"])
            ops = sum(len(t["ops"]) for t in slowest["stages"])
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
