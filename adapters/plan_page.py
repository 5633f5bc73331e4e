"""A plan as one server-rendered HTML page: headline numbers, cluster map, schedule Gantt chart.

Static HTML with the two SVGs inline and a few lines of inline CSS: no
script, font or stylesheet from anywhere, so it works offline and in a
screenshot exactly as in a browser.
"""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from urllib.parse import quote

from adapters.cluster_map_svg import cluster_map_svg
from adapters.gantt_svg import KIND_COLORS, KIND_NAMES, gantt_svg
from adapters.registry import replica_schedule
from api.schemas import Plan

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI','DejaVu Sans',Arial,sans-serif;margin:24px;color:#222;
background:#fafafa}
h1{font-size:22px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}
.sub{color:#666;font-size:13px;margin-bottom:14px}
.facts{display:flex;flex-wrap:wrap;gap:10px;margin:0;padding:0}
.fact{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:120px}
.fact dt{font-size:11px;color:#666;text-transform:uppercase;letter-spacing:.04em}
.fact dd{margin:2px 0 0;font-size:18px;font-weight:600}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px;overflow-x:auto}
.card svg{display:block;max-width:100%;height:auto}
.explain{font-size:13px;color:#444;line-height:1.7}
.sw{display:inline-block;width:12px;height:12px;vertical-align:-1px;margin:0 4px 0 10px;border:1px solid #0002}
.note{color:#8a4b00;background:#fff6e5;border:1px solid #f0d8a8;border-radius:6px;padding:8px 12px}
nav{font-size:14px;margin-bottom:8px}nav a,nav strong{margin-right:12px}a{color:#0b62a4}
"""


def plan_page_html(plan: Plan, replica_id: int | None = None, slow_speeds: Mapping[str, float] | None = None) -> str:
    """The page for one plan; `replica_id` picks the Gantt chart's replica (default: the slowest)."""
    title = f"resiplan · {plan.model or 'plan'} · {plan.plan_id}"
    return "\n".join([
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        # An empty icon: otherwise the browser asks for /favicon.ico and logs the 404 as a console error.
        '<link rel="icon" href="data:,">',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        _header(plan),
        '<h2 id="cluster">Cluster map</h2>',
        f'<div class="card cluster">{cluster_map_svg(plan, slow_speeds)}</div>',
        '<h2 id="schedule">Pipeline schedule</h2>',
        _schedule_section(plan, replica_id),
        _legend(),
        _links(plan),
        "</body></html>\n",
    ])


def _header(plan: Plan) -> str:
    predicted = plan.predicted
    schedule = plan.pipeline_schedule
    facts = [
        ("status", plan.status),
        ("iteration time", f"{predicted.iteration_time_s:,.3f} s"),
        ("tokens / s", f"{predicted.tokens_per_s:,.0f}"),
        ("MFU", f"{predicted.mfu * 100:.1f} %"),
        ("schedule", schedule.name if schedule is not None else plan.schedule),
        ("bubble", f"{schedule.bubble_fraction * 100:.1f} %" if schedule is not None else "n/a"),
        ("replicas", str(len(plan.replicas))),
    ]
    stages = sorted({len(r.stages) for r in plan.replicas})
    sub = (f"plan {plan.plan_id} · {'uniform' if plan.uniform else 'non-uniform'} layout · "
           f"{'/'.join(map(str, stages))} pipeline stages · micro-batch {plan.micro_batch_size} · "
           f"recompute {plan.recompute} · ZeRO-{plan.zero_stage} · solver {plan.solver.status} "
           f"in {plan.solver.wall_time_s:.2f} s")
    items = "".join(f'<div class="fact"><dt>{escape(k)}</dt><dd>{escape(v)}</dd></div>' for k, v in facts)
    return (f"<header><h1>{escape(plan.model or 'Plan')}</h1><div class=\"sub\">{escape(sub)}</div>"
            f'<dl class="facts">{items}</dl></header>')


def _schedule_section(plan: Plan, replica_id: int | None) -> str:
    if plan.pipeline_schedule is None or not plan.pipeline_schedule.replicas:
        return '<p class="note">This plan carries no pipeline schedule; plan it again with this resiplan version.</p>'
    shown = replica_schedule(plan, replica_id)
    entries = plan.pipeline_schedule.replicas
    nav = ""
    if len(entries) > 1:
        links = []
        for entry in sorted(entries, key=lambda e: e.replica_ids[0]):
            label = _replica_range(entry.replica_ids) + f" ({entry.schedule}, {entry.makespan_ms:,.1f} ms)"
            if entry is shown:
                links.append(f"<strong>{escape(label)}</strong>")
            else:
                links.append(f'<a href="?replica={entry.replica_ids[0]}#schedule">{escape(label)}</a>')
        nav = f'<nav class="replicas">Timelines: {" ".join(links)}</nav>'
    return f'{nav}<div class="card gantt-card">{gantt_svg(plan, replica_id)}</div>'


def _replica_range(ids: list[int]) -> str:
    if len(ids) == 1:
        return f"replica {ids[0]}"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"replicas {ids[0]}–{ids[-1]}"
    return f"replicas {', '.join(map(str, ids[:4]))}{' …' if len(ids) > 4 else ''}"


def _legend() -> str:
    kinds = "".join(f'<span class="sw" style="background:{color}"></span>{escape(kind)} = {KIND_NAMES[kind]}'
                    for kind, color in KIND_COLORS.items())
    return (
        '<p class="explain"><strong>Gantt:</strong> one row per pipeline stage, time in ms;'
        f"{kinds}; grey gaps are idle time; a red-outlined row is a slow stage (speed &lt; 1). "
        "Label <code>F3.1</code> = forward of microbatch 3 on model chunk 1 (interleaved).<br>"
        "<strong>Cluster map:</strong> one row per node, one cell per GPU; hue = replica, lightness = stage "
        "(darker = earlier); grey = unused; dark with × = failed; orange hatching = slow GPU. "
        "Hover a cell or an op for details.</p>"
    )


def _links(plan: Plan) -> str:
    plan_id = quote(plan.plan_id, safe="")
    return (f'<p class="explain">Raw: <a href="/v1/plans/{plan_id}">plan JSON</a> · '
            f'<a href="/v1/plans/{plan_id}/schedule.svg">schedule.svg</a></p>')
