"""Regenerate the README's pictures: docs/schedule.svg and docs/plan-page.png.

    .venv/bin/python docs/make_pictures.py [--request docs/slow-gpu-request.json] [--out-dir docs]

Plans the request with `api.tasks.planning.plan_for`, writes the Gantt chart of the
replica the plan page shows by default (the one holding the slowest GPU) as
SVG, and screenshots the plan page (the same HTML that GET /ui/plans/{id}
serves, script included) in headless Chromium. Needs Debian's chromium at
/usr/bin/chromium and the `playwright` package; no browser download. Prints
the figures the README's paragraph about the picture quotes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from api.tasks.planning import plan_for
from render.gantt_svg import gantt_svg
from render.plan_page import featured_replica_id, plan_page_html
from wire.convert import resolve_gpu
from wire.schemas import Plan, PlanRequest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1500, "height": 900}


def request_slow_speeds(request: PlanRequest) -> dict[str, float]:
    """The request knows which GPU is slow; the plan only knows which stage is (see render.cluster_map_svg)."""
    return {slow.device: slow.speed for slow in request.failures.slow}


def screenshot_html(html: str, png_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT, device_scale_factor=1)
            page.set_content(html, wait_until="load")
            page.screenshot(path=str(png_path), full_page=True)
        finally:
            browser.close()


def make_pictures(request: PlanRequest, out_dir: Path) -> Plan:
    plan = plan_for(request)
    if plan.pipeline_schedule is None:
        raise SystemExit("plan_for returned no pipeline_schedule: nothing to draw")
    if plan.gpu_memory_gib is None:  # a service that does not record it yet: the request knows the GPU
        plan = plan.model_copy(update={"gpu_memory_gib": resolve_gpu(request.cluster.gpu).memory_gib})
    slow_speeds = request_slow_speeds(request)
    out_dir.mkdir(parents=True, exist_ok=True)
    shown = featured_replica_id(plan, slow_speeds)
    (out_dir / "schedule.svg").write_text(gantt_svg(plan, shown), encoding="utf-8")
    screenshot_html(plan_page_html(plan, None, slow_speeds), out_dir / "plan-page.png")
    return plan


def describe(plan: Plan) -> list[str]:
    """One line per replica: what the README's paragraph says about the picture."""
    lines = []
    for replica in plan.replicas:
        stages = ", ".join(f"stage {s.id}: {'+'.join(s.devices)} TP {s.tp} layers [{s.layers[0]}, {s.layers[1]}) "
                           f"{s.memory_gib:.1f} GiB speed {s.speed:g}" for s in replica.stages)
        lines.append(f"replica {replica.id}: {replica.num_microbatches} microbatches; {stages}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request", type=Path, default=REPO / "docs" / "slow-gpu-request.json")
    parser.add_argument("--out-dir", type=Path, default=REPO / "docs")
    args = parser.parse_args(argv)
    request = PlanRequest.model_validate(json.loads(args.request.read_text(encoding="utf-8")))
    plan = make_pictures(request, args.out_dir)
    schedule = plan.pipeline_schedule
    print(f"{args.out_dir / 'schedule.svg'}, {args.out_dir / 'plan-page.png'}: plan {plan.plan_id}, "
          f"{schedule.name}, bubble {schedule.bubble_fraction:.1%}, iteration {plan.predicted.iteration_time_s:.3f} s")
    for entry in schedule.replicas:
        print(f"timeline of replicas {entry.replica_ids}: {entry.schedule}, makespan {entry.makespan_ms:,.1f} ms")
    print("\n".join(describe(plan)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
