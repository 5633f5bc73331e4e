"""A plan as one server-rendered HTML page: headline numbers, cluster map, stage table, schedule Gantt chart.

Static HTML with the two SVGs inline, inline CSS and one constant inline script (zoom and pan for
the Gantt chart, render.gantt_zoom_script): no script, font or stylesheet from anywhere, so it
works offline and in a screenshot exactly as in a browser. Every plan-derived string goes through
render.markup for its context.

The chart shows, unless a replica is asked for, the replica holding the slowest GPU (else one
beside a failed GPU, else the slowest replica): the one the planner had to treat differently.

`link_query` (e.g. a view link's `expires` and `signature`) is appended to every link back at the
service, so the page's links keep working when the service requires authentication.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from adapters.registry import format_names, replica_schedule
from cost_models.device import DeviceIdError, DeviceSpec
from render.cluster_map_svg import (
    ClusterMapError,
    MapLegend,
    cluster_map_svg,
    map_legend,
    slow_marks,
)
from render.gantt_svg import KIND_COLORS, KIND_NAMES, gantt_svg
from render.gantt_zoom_script import GANTT_ZOOM_JS
from render.markup import html_text, service_href, url_path_segment
from render.stage_table import replica_label, stage_table_html
from wire.schemas import Plan

MAX_LEGEND_REPLICAS = 64  # past this the map's legend names the first ones; the table lists every one
EXPORT_FORMATS_SHOWN = ("megatron", "deepspeed", "torchtitan", "torch-csv")

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI','DejaVu Sans',Arial,sans-serif;margin:24px;color:#222;
background:#fafafa}
h1{font-size:22px;margin:0 0 4px;overflow-wrap:anywhere}h2{font-size:16px;margin:24px 0 8px}
.sub{color:#666;font-size:13px;margin-bottom:14px;overflow-wrap:anywhere}
.facts{display:flex;flex-wrap:wrap;gap:10px;margin:0;padding:0}
.fact{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:110px}
.fact dt{font-size:11px;color:#666;text-transform:uppercase;letter-spacing:.04em}
.fact dd{margin:2px 0 0;font-size:18px;font-weight:600}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px;overflow-x:auto}
.card svg{display:block;max-width:100%;height:auto}
.map-layout{display:flex;flex-wrap:wrap;gap:16px 28px;align-items:flex-start}
.map-legend{font-size:13px;line-height:1.6;flex:1 1 280px;min-width:240px}
.map-legend .headline{font-weight:600;margin-bottom:4px}
.map-legend ul{list-style:none;margin:0;padding:0;display:flex;flex-wrap:wrap;gap:2px 14px}
.chip,.sw{display:inline-block;width:12px;height:12px;vertical-align:-1px;margin-right:5px;border:1px solid #0002}
.sw.unused{background:#cfcfcf}.sw.failed{background:#2b2b2b}
.sw.slow{border:2px solid #e67e00;width:10px;height:10px;
background:linear-gradient(135deg,transparent 50%,#fff 50%),
repeating-linear-gradient(45deg,#e67e00 0 1.5px,#fff 1.5px 3.5px)}
.sw.slow-stage{border:1px dashed #e67e00;background:#fff}
.shades span{display:inline-block;width:6px;height:12px;vertical-align:-1px}
table.stages{border-collapse:collapse;font-size:13px;width:100%}
table.stages th,table.stages td{padding:4px 8px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
table.stages thead th{font-size:11px;color:#666;text-transform:uppercase;letter-spacing:.03em;
border-bottom:1px solid #ccc}
table.stages tr.group>*{border-top:2px solid #ddd}
table.stages .num{text-align:right;font-variant-numeric:tabular-nums}
table.stages td.microbatches{font-weight:600;font-size:15px}
table.stages th.replica{font-weight:600;white-space:nowrap}
table.stages tr.slow td:not([rowspan]){background:#fff3e6}
table.stages .devices{font-family:ui-monospace,Menlo,Consolas,'DejaVu Sans Mono',monospace;font-size:12px;
overflow-wrap:anywhere}
table.stages .layers,table.stages td.num,table.stages .speed{white-space:nowrap}
@media (max-width:900px){table.stages{font-size:12px}table.stages th,table.stages td{padding:3px 4px}
table.stages .layers .hint,.memory .bar{display:none}}
.memory{white-space:nowrap;font-variant-numeric:tabular-nums}
.bar{display:inline-block;width:60px;height:8px;background:#eee;border-radius:4px;margin-right:6px;overflow:hidden}
.bar span{display:block;height:100%;background:#5b8dd6}.bar.full span{background:#d9822b}
.slow-speed{color:#c0392b}.hint{color:#777;font-size:12px}
.tag{font-size:11px;font-weight:normal;background:#e8f0fb;color:#0b62a4;border-radius:3px;padding:0 4px}
.explain{font-size:13px;color:#444;line-height:1.7}
.note{color:#8a4b00;background:#fff6e5;border:1px solid #f0d8a8;border-radius:6px;padding:8px 12px}
nav{font-size:14px;margin-bottom:8px;line-height:1.8}nav a,nav strong{margin-right:12px;white-space:nowrap}
a{color:#0b62a4}
.gantt-tools{display:flex;flex-wrap:wrap;align-items:center;gap:6px;margin:0 0 8px;font-size:13px}
.gantt-tools[hidden]{display:none}
.gantt-tools button{font:inherit;padding:2px 10px;border:1px solid #bbb;border-radius:4px;background:#f6f6f6;
cursor:pointer}
.gantt-tools .readout{margin-left:8px;font-variant-numeric:tabular-nums}
.gantt-card.zoomable svg{max-width:none;touch-action:pan-y;user-select:none;cursor:grab}
.gantt-card.zoomable svg.dragging{cursor:grabbing}
.gantt-card:focus-visible{outline:2px solid #0b62a4}
"""


def plan_page_html(plan: Plan, replica_id: int | None = None, slow_speeds: Mapping[str, float] | None = None, *,
                   link_query: Mapping[str, str] | None = None) -> str:
    """The page for one plan; `replica_id` picks the Gantt chart's replica (default: featured_replica_id)."""
    # An empty mapping is "no slow GPU known": fall back to what the plan's stage speeds say.
    speeds = dict(slow_speeds) if slow_speeds else None
    slow_devices = slow_marks(plan, speeds)[0]
    has_schedule = plan.pipeline_schedule is not None and bool(plan.pipeline_schedule.replicas)
    shown_id, shown_ids, featured = None, frozenset(), featured_replica_id(plan, speeds)
    if has_schedule:
        wanted = replica_id if replica_id is not None else featured
        shown = replica_schedule(plan, wanted)
        shown_id = wanted if wanted is not None else shown.replica_ids[0]
        shown_ids = frozenset(shown.replica_ids)
    links = _Links(plan.plan_id, link_query)
    title = f"resiplan · {plan.model or 'plan'} · {plan.plan_id}"
    table = stage_table_html(plan, shown_ids, links.timeline if has_schedule else _no_link, slow_devices)
    return "\n".join([
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        # An empty icon: otherwise the browser asks for /favicon.ico and logs the 404 as a console error.
        '<link rel="icon" href="data:,">',
        f"<title>{html_text(title)}</title><style>{_CSS}</style></head><body>",
        _header(plan),
        _comparison_section(plan),
        '<h2 id="cluster">Cluster map</h2>',
        _cluster_section(plan, speeds),
        '<h2 id="stages">Replicas and stages</h2>',
        f'<div class="card table-card">{table}</div>',
        '<h2 id="schedule">Pipeline schedule</h2>',
        _schedule_section(plan, shown_id, featured, links) if has_schedule else
        '<p class="note">This plan carries no pipeline schedule; plan it again with this resiplan version.</p>',
        _legend(),
        _raw_links(shown_id, links),
        f"<script>{GANTT_ZOOM_JS}</script>" if has_schedule else "",
        "</body></html>\n",
    ])


def featured_replica_id(plan: Plan, slow_speeds: Mapping[str, float] | None) -> int | None:
    """The replica holding the slowest GPU; else one using a node with a failed GPU; else None (the slowest)."""
    exact, in_slow_stage = slow_marks(plan, dict(slow_speeds) if slow_speeds else None)
    speeds = {**in_slow_stage, **exact}
    entries = plan.pipeline_schedule.replicas if plan.pipeline_schedule is not None else []
    timed = {i for entry in entries for i in entry.replica_ids}
    slowest: tuple[float, int] | None = None
    for replica in plan.replicas:
        for stage in replica.stages:
            speed = min([speeds[d] for d in stage.devices if d in speeds] + [stage.speed])
            if speed < 1.0 and replica.id in timed and (slowest is None or (speed, replica.id) < slowest):
                slowest = (speed, replica.id)
    if slowest is not None:
        return slowest[1]
    failed_nodes = {_node(device) for device in plan.excluded_devices} - {None}
    for replica in plan.replicas:
        if replica.id in timed and any(_node(d) in failed_nodes for s in replica.stages for d in s.devices):
            return replica.id
    return None


def _node(device: str) -> int | None:
    """The node of a device id (or "n:*"); None for text that is none: a stored plan is data a client sent."""
    try:
        return DeviceSpec.parse(device).node
    except DeviceIdError:
        return None


@dataclass(frozen=True)
class _Links:
    """Every href back at the service, carrying the caller's link_query."""

    plan_id: str
    link_query: Mapping[str, str] | None

    @property
    def _plan_path(self) -> str:
        return f"/v1/plans/{url_path_segment(self.plan_id)}"

    def timeline(self, replica_id: int) -> str:
        """This page showing another replica's chart: relative, so it works under any mount point."""
        return service_href("", {"replica": replica_id}, self.link_query, fragment="schedule")

    def plan_json(self) -> str:
        return service_href(self._plan_path, None, self.link_query)

    def schedule_svg(self, replica_id: int) -> str:
        return service_href(f"{self._plan_path}/schedule.svg", {"replica": replica_id}, self.link_query)

    def export(self, format_name: str) -> str:
        return service_href(f"{self._plan_path}/export/{url_path_segment(format_name)}", None, self.link_query)


def _no_link(_: int) -> None:
    return None


def _comparison_section(plan: Plan) -> str:
    """On a layout `/v1/compare` compared: its figures beside the best plan's, and each change alone, ranked."""
    comparison = plan.comparison
    if comparison is None:
        return ""
    yours, best = plan.predicted, comparison.best
    rows = [("iteration time s", f"{yours.iteration_time_s:,.3f}", f"{best.iteration_time_s:,.3f}"),
            ("tokens / s", f"{yours.tokens_per_s:,.0f}", f"{best.tokens_per_s:,.0f}"),
            ("MFU", f"{yours.mfu * 100:.1f} %", f"{best.mfu * 100:.1f} %")]
    for key in type(yours.breakdown).model_fields:
        rows.append((key.removesuffix("_s").replace("_", " ") + " s", f"{getattr(yours.breakdown, key):,.3f}",
                     f"{getattr(best.breakdown, key):,.3f}"))
    most_memory_gib = max(stage.memory_gib for replica in plan.replicas for stage in replica.stages)
    rows.append(("fullest stage GiB", f"{most_memory_gib:,.1f}", f"{comparison.best_most_memory_gib:,.1f}"))
    side = "".join(f"<tr><th>{html_text(a)}</th><td>{html_text(b)}</td><td>{html_text(c)}</td></tr>" for a, b, c in rows)
    changes = "".join(
        f"<tr><td>{html_text(c.change)}</td><td>{html_text(f'{c.iteration_time_s:,.3f}')}</td>"
        f"<td>{html_text(f'{c.gain * 100:+.1f} %')}</td></tr>" if c.iteration_time_s is not None else
        f"<tr><td>{html_text(c.change)}</td><td>cannot run</td><td>{html_text(c.why or '')}</td></tr>"
        for c in comparison.changes)
    href = service_href(f"/ui/plans/{url_path_segment(comparison.best_plan_id)}")
    warning = ('<p class="note"><strong>The best plan is slower than this layout, which lies in the space it '
               'searches: a planner bug; please report this request.</strong></p>' if comparison.planner_slower else "")
    return ('<h2 id="comparison">Compared with the best plan</h2>'
            f'<p class="note">The best plan for the same cluster, model and batch is {comparison.speedup:.3f}x as fast: '
            f'<a href="{href}">plan {html_text(comparison.best_plan_id)}</a>. Each change below is applied alone to '
            f'this layout.</p>{warning}'
            f'<div class="card table-card"><table><thead><tr><th></th><th>this layout</th><th>best plan</th></tr></thead>'
            f"<tbody>{side}</tbody></table></div>"
            f'<div class="card table-card"><table><thead><tr><th>change</th><th>iteration time s</th><th>gain</th></tr>'
            f"</thead><tbody>{changes}</tbody></table></div>")


def _header(plan: Plan) -> str:
    predicted = plan.predicted
    schedule = plan.pipeline_schedule
    microbatches = [replica.num_microbatches for replica in plan.replicas]
    facts = [
        ("status", plan.status),
        ("iteration time", f"{predicted.iteration_time_s:,.3f} s"),
        ("tokens / s", f"{predicted.tokens_per_s:,.0f}"),
        ("MFU", f"{predicted.mfu * 100:.1f} %"),
        ("schedule", schedule.name if schedule is not None else plan.schedule),
        ("bubble", f"{schedule.bubble_fraction * 100:.1f} %" if schedule is not None else "n/a"),
        ("replicas", str(len(plan.replicas))),
        ("microbatches", _microbatch_summary(microbatches)),
    ]
    if plan.gpu_memory_gib is not None:
        facts.append(("GPU memory", f"{plan.gpu_memory_gib:g} GiB"))
    if plan.memory_reserve_gib is not None:
        facts.append(("Memory reserve", f"{plan.memory_reserve_gib:g} GiB per GPU left free"))
    if plan.ep > 1:
        stage = plan.replicas[0].stages[0]
        expert_tp = stage.tp if plan.etp is None else plan.etp
        replicas = max(1, plan.ep * expert_tp // (stage.tp * stage.cp))  # a replica's CP ranks first
        whole = "whole experts" if expert_tp == 1 else f"each expert split over {expert_tp} GPUs"
        facts.append(("Expert parallelism", f"experts split over {plan.ep} GPUs of {replicas} "
                                            f"{'replica' if replicas == 1 else 'replicas'} ({whole}); each group "
                                            "runs at its slowest GPU"))
    if plan.zero_stage >= 1 and plan.dp_shard is not None and plan.dp_shard < len(plan.replicas):
        facts.append(("Hybrid sharding", f"ZeRO state sharded over groups of {plan.dp_shard} replicas, "
                                         f"{len(plan.replicas) // plan.dp_shard} groups holding the same shards"))
    stages = sorted({len(r.stages) for r in plan.replicas})
    sub = (f"plan {plan.plan_id} · {'uniform' if plan.uniform else 'non-uniform'} layout · "
           f"{'/'.join(map(str, stages))} pipeline stages · micro-batch {plan.micro_batch_size} · "
           f"recompute {plan.recompute} · ZeRO-{plan.zero_stage} · solver {plan.solver.status} "
           f"in {plan.solver.wall_time_s:.2f} s")
    items = "".join(f'<div class="fact"><dt>{html_text(k)}</dt><dd>{html_text(v)}</dd></div>' for k, v in facts)
    # <bdi>: a right-to-left override in a model name cannot reorder the text around it.
    return (f"<header><h1><bdi>{html_text(plan.model or 'Plan')}</bdi></h1><div class=\"sub\">{html_text(sub)}</div>"
            f'<dl class="facts">{items}</dl></header>')


def _microbatch_summary(counts: list[int]) -> str:
    """`21 / 22 / 21` for a few replicas, `16–17` for many."""
    if not counts:
        return "0"
    if len(counts) <= 8:
        return " / ".join(map(str, counts))
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}–{high}"


def _cluster_section(plan: Plan, slow_speeds: Mapping[str, float] | None) -> str:
    try:
        svg, legend = cluster_map_svg(plan, slow_speeds), map_legend(plan, slow_speeds)
    except ClusterMapError as error:
        return f'<p class="note">The cluster map cannot be drawn: {html_text(error)}.</p>'
    return (f'<div class="card cluster"><div class="map-layout"><div class="map">{svg}</div>'
            f"{_map_legend_html(legend)}</div></div>")


def _map_legend_html(legend: MapLegend) -> str:
    replicas = [f'<li><span class="chip" style="background:{color}"></span>replica {replica_id}</li>'
                for replica_id, color in legend.replicas[:MAX_LEGEND_REPLICAS]]
    if len(legend.replicas) > MAX_LEGEND_REPLICAS:
        more = len(legend.replicas) - MAX_LEGEND_REPLICAS
        replicas.append(f"<li>… {more} more: hover a cell, or see the table</li>")
    shades = "".join(f'<span style="background:{shade}"></span>' for shade in legend.stage_shades)
    marks = [f'<li><span class="shades">{shades}</span> stage: darker = earlier</li>',
             '<li><span class="sw unused"></span>unused</li>']
    if legend.has_failed:
        marks.append('<li><span class="sw failed"></span>failed ×</li>')
    if legend.has_slow:
        marks.append('<li><span class="sw slow"></span>slow GPU: hatched corner, the rest shows what it runs</li>')
    if legend.has_slow_stage:
        marks.append('<li><span class="sw slow-stage"></span>in a slow stage</li>')
    return (f'<div class="map-legend"><div class="headline">{html_text(legend.headline)}</div>'
            f'<ul class="replica-legend">{"".join(replicas)}</ul><ul class="marks">{"".join(marks)}</ul>'
            '<div class="hint">Cells say replica·stage ("r0·s1") when they are large enough; '
            "hover any cell for its layers, TP, microbatches and memory.</div></div>")


def _schedule_section(plan: Plan, shown_id: int, featured: int | None, links: _Links) -> str:
    shown = replica_schedule(plan, shown_id)
    entries = plan.pipeline_schedule.replicas
    nav = ""
    if len(entries) > 1:
        items = []
        for entry in sorted(entries, key=lambda e: e.replica_ids[0]):
            label = replica_label(entry.replica_ids) + f" ({entry.schedule}, {entry.makespan_ms:,.1f} ms)"
            if featured is not None and featured in entry.replica_ids:
                label += " · slow GPU"
            if entry is shown:
                items.append(f"<strong>{html_text(label)}</strong>")
            else:
                items.append(f'<a href="{links.timeline(entry.replica_ids[0])}">{html_text(label)}</a>')
        nav = f'<nav class="replicas">Timelines: {" ".join(items)}</nav>'
    tools = (
        '<div class="gantt-tools" data-gantt-tools hidden>'
        '<button type="button" data-gantt-action="in" title="Zoom in (+, Ctrl+wheel, double-click)">+ zoom in</button>'
        '<button type="button" data-gantt-action="out" title="Zoom out (-, Shift+double-click)">− zoom out</button>'
        '<button type="button" data-gantt-action="left" title="Earlier (←, drag, Shift+wheel)">◀ earlier</button>'
        '<button type="button" data-gantt-action="right" title="Later (→, drag, Shift+wheel)">later ▶</button>'
        '<button type="button" data-gantt-action="reset" title="The whole iteration (0)">whole iteration</button>'
        '<span class="readout" data-gantt-readout aria-live="polite"></span></div>'
    )
    gantt = gantt_svg(plan, shown_id)
    return f'{nav}<div class="card gantt-card" data-gantt-zoom aria-label="pipeline schedule">{tools}{gantt}</div>'


def _legend() -> str:
    kinds = "".join(f'<span class="sw" style="background:{color};margin-left:10px"></span>{html_text(kind)} = '
                    f"{KIND_NAMES[kind]}" for kind, color in KIND_COLORS.items())
    return (
        '<p class="explain"><strong>Gantt:</strong> one row per pipeline stage, time in ms;'
        f"{kinds}; grey gaps are idle time; a red-outlined row is a slow stage (speed &lt; 1). "
        "Label <code>F3.1</code> = forward of microbatch 3 on model chunk 1 (interleaved). "
        "Hover a stage's label for its memory and times, an op for its times. Zoom with the buttons, "
        "Ctrl+wheel or a double-click; drag to pan.<br>"
        "<strong>Cluster map:</strong> one row per node, one cell per GPU; hue = replica, lightness = stage "
        "(darker = earlier); grey = unused; dark with × = failed; orange outline and hatched corner = slow GPU. "
        "Hover a cell for details.</p>"
    )


def _raw_links(shown_id: int | None, links: _Links) -> str:
    parts = [f'<a href="{links.plan_json()}">plan JSON</a>']
    if shown_id is not None:
        parts.append(f'<a href="{links.schedule_svg(shown_id)}">schedule.svg (replica {shown_id})</a>')
    exports = [f'<a href="{links.export(name)}">{html_text(name)}</a>'
               for name in EXPORT_FORMATS_SHOWN if name in format_names()]
    return (f'<p class="explain">Raw: {" · ".join(parts)}'
            f'{" · Trainer configs: " + " · ".join(exports) if exports else ""}</p>')
