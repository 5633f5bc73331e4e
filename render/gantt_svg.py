"""Gantt chart of one replica's pipeline schedule as a self-contained SVG.

One row per stage, time in ms left to right, one rect per operation in the
timeline's order. The row background is the idle colour, so every gap
between ops is visible idle time. Nothing is merged: at 64 stages x 512
microbatches ops are about a pixel wide and stay separate rects; only the
decorations that need room (text labels, hover titles) are dropped on
narrow ops, which keeps the file to about 70 bytes per op (4.5 MB for
64 x 512 1F1B, well under a second to write).

No script, no external font or stylesheet: the file renders the same in a
browser, an <img> tag or an SVG viewer. It carries what a viewer needs to
zoom it (the plan page's script does): the plot's geometry on the root
element, each op's label in `data-op`, the ops of a row in their own group
under one clip path, and op labels in a group of their own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from adapters.registry import replica_schedule
from planner.schedules.ops import ScheduleError, parse_op
from render.markup import xml_text
from render.number_format import group_text, memory_text, ms_text, px, speed_text
from wire.schemas import Plan, ReplicaSchedule, Stage, StageTimeline

# Colour-blind-safe (Okabe-Ito) fills per op kind, and what the legend calls them.
KIND_COLORS = {"F": "#0072B2", "B": "#009E73", "I": "#E69F00", "W": "#CC79A7"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
OTHER_KIND = "X"  # an op label the schedule grammar does not know (a hand-edited plan file)
OTHER_COLOR = "#777777"
DARK_TEXT_KINDS = ("I", "W")  # white on orange or pink is hard to read
MAX_STYLED_CHUNKS = 16  # later chunks share the lightest shade; bounds the style sheet for any label
IDLE_COLOR = "#e6e6e6"
SLOW_ROW_COLOR = "#fbe3e0"
SLOW_ACCENT = "#c0392b"
CLIP_ID = "gantt-plot"  # one page holds one Gantt chart; the cluster map's ids are prefixed differently

FONT = "system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', Arial, sans-serif"
MONO = "ui-monospace, Menlo, Consolas, 'DejaVu Sans Mono', monospace"

PLOT_WIDTH_PX = 1100.0
ROW_HEIGHT_PX = 20.0
BAR_HEIGHT_PX = 15.0
FEW_STAGES = 8
TALL_ROW_HEIGHT_PX = 30.0
TALL_BAR_HEIGHT_PX = 24.0
LABEL_CHAR_PX = 6.7  # 11 px monospace advance, for sizing the label gutter
OP_CHAR_PX = 5.5  # 9 px monospace advance, for deciding whether an op's label fits
LEGEND_CHAR_PX = 6.2  # 11 px sans advance
LEGEND_WRAP_PX = 640.0  # legend lines wrap here, so a narrow window shows the chart without a scrollbar
LEGEND_LINE_PX = 18.0
MIN_TITLE_WIDTH_PX = 3.0  # narrower ops get no hover title: nobody can point at them
MIN_SEPARATED_WIDTH_PX = 4.0  # below this a white seam between ops would wash the colours out
LABEL_GAP_PX = 10.0
SLOW_CLASS = ' class="slow"'
TITLE_HEIGHT_PX = 52.0
AXIS_HEIGHT_PX = 22.0
MARGIN_PX = 12.0
_PLAIN_DEVICE = re.compile(r"([0-9]+):([0-9]+)")


@dataclass(frozen=True)
class Geometry:
    """Where the plot area is and how many px one ms is."""

    plot_left_px: float
    plot_top_px: float
    px_per_ms: float
    row_height_px: float
    bar_height_px: float

    def x_px(self, time_ms: float) -> float:
        return self.plot_left_px + time_ms * self.px_per_ms


@dataclass(frozen=True)
class RowFacts:
    """What a row's hover title says about its stage."""

    stage: Stage | None
    timeline: StageTimeline
    num_microbatches: int | None
    gpu_memory_gib: float | None


def render(plan: Plan, replica_id: int | None = None) -> str:
    """The export registry's entry point: the chart as an SVG document."""
    return gantt_svg(plan, replica_id)


def gantt_svg(plan: Plan, replica_id: int | None = None) -> str:
    entry = replica_schedule(plan, replica_id)
    stages = replica_stages(plan, entry)
    microbatches = replica_microbatches(plan, entry)
    labels = [row_label(timeline.stage, stages.get(timeline.stage)) for timeline in entry.stages]
    columns_px = label_columns_px(labels)
    makespan_ms = entry.makespan_ms if math.isfinite(entry.makespan_ms) and entry.makespan_ms > 0 else 0.0
    legend, legend_lines = _legend(kinds_present(entry), _chunk_count(entry), any(_is_slow(s) for s in stages.values()))
    geometry = Geometry(
        plot_left_px=columns_px[-1],
        plot_top_px=TITLE_HEIGHT_PX + legend_lines * LEGEND_LINE_PX + AXIS_HEIGHT_PX,
        px_per_ms=PLOT_WIDTH_PX / makespan_ms if makespan_ms > 0 else 0.0,
        # A short pipeline gets taller bars: the chart is a strip otherwise.
        row_height_px=ROW_HEIGHT_PX if len(entry.stages) > FEW_STAGES else TALL_ROW_HEIGHT_PX,
        bar_height_px=BAR_HEIGHT_PX if len(entry.stages) > FEW_STAGES else TALL_BAR_HEIGHT_PX,
    )
    width_px = geometry.plot_left_px + PLOT_WIDTH_PX + MARGIN_PX
    height_px = geometry.plot_top_px + len(entry.stages) * geometry.row_height_px + MARGIN_PX
    separated = typical_op_width_px(entry, geometry) >= MIN_SEPARATED_WIDTH_PX
    parts = [
        (f'<svg xmlns="http://www.w3.org/2000/svg" class="gantt" width="{px(width_px)}" height="{px(height_px)}" '
         f'viewBox="0 0 {px(width_px)} {px(height_px)}" font-family="{xml_text(FONT)}" font-size="12" '
         f'data-plot-left-px="{px(geometry.plot_left_px)}" data-plot-width-px="{px(PLOT_WIDTH_PX)}" '
         f'data-margin-px="{px(MARGIN_PX)}" data-makespan-ms="{makespan_ms!r}">'),
        _style(_chunk_count(entry), separated),
        (f'<defs><clipPath id="{CLIP_ID}"><rect x="{px(geometry.plot_left_px)}" y="0" width="{px(PLOT_WIDTH_PX)}" '
         f'height="{px(geometry.row_height_px)}"/></clipPath></defs>'),
        '<rect width="100%" height="100%" fill="#ffffff"/>',
        _title(plan, entry, microbatches),
        legend,
        _axis(makespan_ms, geometry, len(entry.stages)),
    ]
    for row, (timeline, label) in enumerate(zip(entry.stages, labels)):
        facts = RowFacts(stages.get(timeline.stage), timeline, microbatches, plan.gpu_memory_gib)
        parts.append(_row(row, facts, label, columns_px, makespan_ms, geometry))
    parts.append("</svg>\n")
    return "\n".join(parts)


def label_columns_px(labels: list[tuple[str, ...]]) -> list[float]:
    """Left edge of each label column, then of the plot: columns as wide as their longest cell."""
    edges, x_px = [], MARGIN_PX
    for column in range(len(labels[0]) if labels else 0):
        edges.append(x_px)
        widest = max(len(label[column]) for label in labels)
        x_px += widest * LABEL_CHAR_PX + (LABEL_GAP_PX if widest else 0)
    edges.append(x_px + LABEL_GAP_PX)
    return edges


def typical_op_width_px(entry: ReplicaSchedule, geometry: Geometry) -> float:
    """Median op width of the first stage: whether there is room for separators between ops."""
    first = entry.stages[0] if entry.stages else None
    if first is None or not first.ops:
        return 0.0
    widths = sorted(end - start for start, end in zip(first.start_ms, first.end_ms))
    return widths[len(widths) // 2] * geometry.px_per_ms if widths else 0.0


def replica_stages(plan: Plan, entry: ReplicaSchedule) -> dict[int, Stage]:
    """Stage index -> the wire stage of the first replica sharing this timeline."""
    replica = next((r for r in plan.replicas if entry.replica_ids and r.id == entry.replica_ids[0]), None)
    return {} if replica is None else dict(enumerate(replica.stages))


def replica_microbatches(plan: Plan, entry: ReplicaSchedule) -> int | None:
    replica = next((r for r in plan.replicas if entry.replica_ids and r.id == entry.replica_ids[0]), None)
    return None if replica is None else replica.num_microbatches


def kinds_present(entry: ReplicaSchedule) -> list[str]:
    seen = {op_kind(op) for timeline in entry.stages for op in timeline.ops}
    return [kind for kind in (*KIND_COLORS, OTHER_KIND) if kind in seen]


def op_kind(op: str) -> str:
    """F, B, I or W; anything else (a hand-edited plan file) is OTHER_KIND, never raw text in a class."""
    kind = op[:1]
    return kind if kind in KIND_COLORS else OTHER_KIND


def op_chunk(op: str) -> int:
    """Model chunk of an op label, capped for styling; the plain "F3" form (chunk 0) skips the parser."""
    if "." not in op:
        return 0
    try:
        chunk = parse_op(op).chunk
    except ScheduleError:
        return 0
    return min(max(chunk, 0), MAX_STYLED_CHUNKS - 1)


def row_label(index: int, stage: Stage | None) -> tuple[str, str, str, str, str]:
    """Label columns: ("stage 2", "TP 4", "layers [8, 16)", "3:0-3", "slow ×0.5" or "")."""
    if stage is None:
        return f"stage {index}", "", "", "", ""
    return (
        f"stage {stage.id}",
        group_text(stage.tp, stage.cp),
        f"layers [{stage.layers[0]}, {stage.layers[1]})",
        device_range(stage.devices),
        f"slow ×{speed_text(stage.speed)}" if _is_slow(stage) else "",
    )


def device_range(devices: list[str]) -> str:
    """Compact device list: "3:0-3" for GPUs 0..3 of node 3, "3:6-7,4:0-1" across nodes.

    An id not of the "<node>:<gpu>" form (a hand-edited plan) is listed as it is, after the others.
    """
    by_node: dict[str, list[int]] = {}
    odd: list[str] = []
    for device in devices:
        match = _PLAIN_DEVICE.fullmatch(device)
        if match is None:
            odd.append(device)
        else:
            by_node.setdefault(match.group(1), []).append(int(match.group(2)))
    parts = []
    for node, gpus in by_node.items():
        gpus.sort()
        runs: list[list[int]] = []
        for gpu in gpus:
            if runs and gpu == runs[-1][1] + 1:
                runs[-1][1] = gpu
            else:
                runs.append([gpu, gpu])
        parts.append(f"{node}:" + "+".join(str(a) if a == b else f"{a}-{b}" for a, b in runs))
    return ",".join(parts + odd)


def nice_step_ms(span_ms: float, target_ticks: int = 10) -> float:
    """A 1, 2 or 5 x 10^k step giving about `target_ticks` ticks over the span."""
    if not span_ms > 0 or not math.isfinite(span_ms):
        return 1.0
    raw = span_ms / target_ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _chunk_count(entry: ReplicaSchedule) -> int:
    return max((op_chunk(op) for t in entry.stages for op in t.ops), default=0) + 1


def _is_slow(stage: Stage) -> bool:
    return stage.speed < 1.0


def _style(chunks: int, separated: bool) -> str:
    """Rules scoped to `svg.gantt`: inline in an HTML page, an SVG's <style> applies to the whole page."""
    rules = [f".{kind}{{fill:{color}}}" for kind, color in KIND_COLORS.items()]
    rules.append(f".{OTHER_KIND}{{fill:{OTHER_COLOR}}}")
    # Later model chunks of an interleaved stage: same kind colour, lighter.
    rules += [f".c{c}{{fill-opacity:{1 - 0.5 * c / max(chunks - 1, 1):.2f}}}" for c in range(1, chunks)]
    if separated:
        # Back-to-back ops of one kind (warm-up forwards) would read as one long op without a seam. The
        # seam keeps its width when a viewer stretches the row to zoom in.
        rules.append(".ops rect{stroke:#fff;stroke-width:0.75;vector-effect:non-scaling-stroke}")
    else:
        # Sub-pixel ops: anti-aliasing blends each one with the idle background and washes the
        # colours out; snapping to whole pixels keeps them saturated and gap-free.
        rules.append(".ops{shape-rendering:crispEdges}")
    rules += [
        f".lbl{{font-family:{MONO};font-size:11px;fill:#222}}",
        f".lbl .slow{{font-weight:bold;fill:{SLOW_ACCENT}}}",
        f".op{{font-family:{MONO};font-size:9px;fill:#fff;text-anchor:middle;pointer-events:none}}",
        ".op.dark{fill:#222}",
        ".tick{font-size:10px;fill:#555;text-anchor:middle}",
    ]
    return "<style>" + "".join(f"svg.gantt {rule}" for rule in rules) + "</style>"


def _title(plan: Plan, entry: ReplicaSchedule, microbatches: int | None) -> str:
    ids = entry.replica_ids
    more = " …" if len(ids) > 6 else ""
    who = f"replica {ids[0]}" if len(ids) == 1 else f"replicas {', '.join(map(str, ids[:6]))}{more}"
    headline = (
        f"{entry.schedule} schedule · {who} · makespan {ms_text(entry.makespan_ms)} ms · "
        f"bubble {entry.bubble_fraction * 100:.1f} %"
    )
    ops_per_stage = max((len(t.ops) for t in entry.stages), default=0)
    runs = f"{microbatches} microbatches · " if microbatches is not None else ""
    subline = (f"model {plan.model or '?'} · {len(entry.stages)} stages · {runs}{ops_per_stage} ops per stage · "
               f"plan {plan.plan_id}")
    return (
        f'<text class="title" x="{px(MARGIN_PX)}" y="22" font-size="16" font-weight="bold">'
        f"{xml_text(headline)}</text>\n"
        f'<text class="subtitle" x="{px(MARGIN_PX)}" y="40" font-size="11" fill="#555">{xml_text(subline)}</text>'
    )


def _legend(kinds: list[str], chunks: int, has_slow: bool) -> tuple[str, int]:
    """The legend and how many lines it takes (it wraps at LEGEND_WRAP_PX)."""
    names = {**KIND_NAMES, OTHER_KIND: "unknown op"}
    items = [(f'class="{kind}"', f"{kind} {names[kind]}" if kind != OTHER_KIND else names[kind]) for kind in kinds]
    if chunks > 1:
        items.append(('class="F c1"', f"lighter: later model chunk (F3.1 = chunk 1 of {chunks})"))
    items.append((f'fill="{IDLE_COLOR}"', "idle"))
    if has_slow:
        items.append((f'fill="{SLOW_ROW_COLOR}" stroke="{SLOW_ACCENT}"', "slow stage (speed < 1)"))
    x_px, line, parts = MARGIN_PX, 0, ['<g class="legend">']
    for paint, name in items:
        width_px = 19 + len(name) * LEGEND_CHAR_PX + 18
        if x_px > MARGIN_PX and x_px + width_px > MARGIN_PX + LEGEND_WRAP_PX:
            x_px, line = MARGIN_PX, line + 1
        y_px = TITLE_HEIGHT_PX + line * LEGEND_LINE_PX
        parts.append(f'<rect x="{px(x_px)}" y="{px(y_px)}" width="14" height="12" {paint}/>'
                     f'<text x="{px(x_px + 19)}" y="{px(y_px + 10)}" font-size="11">{xml_text(name)}</text>')
        x_px += width_px
    parts.append("</g>")
    return "".join(parts), line + 1


def _axis(makespan_ms: float, geometry: Geometry, rows: int) -> str:
    step_ms = nice_step_ms(makespan_ms)
    top_px = geometry.plot_top_px
    bottom_px = top_px + rows * geometry.row_height_px
    parts = [(f'<text class="axis-unit" x="{px(geometry.plot_left_px - 12)}" y="{px(top_px - 8)}" font-size="10" '
              f'fill="#555" text-anchor="end">time (ms)</text>'),
             f'<g class="axis" data-top-px="{px(top_px)}" data-bottom-px="{px(bottom_px)}">']
    count = int(makespan_ms / step_ms + 1e-9) + 1 if makespan_ms > 0 else 1
    for index in range(count):
        time_ms = index * step_ms
        x_px = px(geometry.x_px(time_ms))
        parts.append(f'<line x1="{x_px}" x2="{x_px}" y1="{px(top_px - 4)}" y2="{px(bottom_px)}" stroke="#d0d0d0" '
                     f'stroke-width="0.5"/><text class="tick" x="{x_px}" y="{px(top_px - 8)}">'
                     f"{ms_text(time_ms)}</text>")
    parts.append("</g>")
    return "".join(parts)


def _row_title(facts: RowFacts) -> str:
    """The hover text of a row's label: everything the planner decided for the stage, memory included."""
    stage, timeline = facts.stage, facts.timeline
    if stage is None:
        return f"stage {timeline.stage}"
    notes = [
        f"stage {stage.id}", group_text(stage.tp, stage.cp), f"layers [{stage.layers[0]}, {stage.layers[1]})",
        f"devices {', '.join(stage.devices)}",
    ]
    if facts.num_microbatches is not None:
        notes.append(f"{facts.num_microbatches} microbatches")
    notes += [
        f"memory {memory_text(stage.memory_gib, facts.gpu_memory_gib)}",
        f"peak activations {timeline.peak_activation_gib:,.1f} GiB",
        f"forward {ms_text(stage.forward_ms)} ms, backward {ms_text(stage.backward_ms)} ms per microbatch",
        f"busy {ms_text(timeline.busy_ms)} ms",
        f"speed ×{speed_text(stage.speed)}",
    ]
    return " · ".join(notes)


def _row(row: int, facts: RowFacts, label: tuple[str, ...], columns_px: list[float], makespan_ms: float,
         geometry: Geometry) -> str:
    stage, timeline = facts.stage, facts.timeline
    y_px = geometry.plot_top_px + row * geometry.row_height_px
    bar_top_px = (geometry.row_height_px - geometry.bar_height_px) / 2
    slow = stage is not None and _is_slow(stage)
    background = SLOW_ROW_COLOR if slow else IDLE_COLOR
    outline = f' stroke="{SLOW_ACCENT}" stroke-width="1.5"' if slow else ""
    stage_id = stage.id if stage is not None else timeline.stage
    slow_column = len(label) - 1
    cells = "".join(
        f'<tspan x="{px(x_px)}"{SLOW_CLASS if column == slow_column else ""}>{xml_text(text)}</tspan>'
        for column, (x_px, text) in enumerate(zip(columns_px, label)) if text
    )
    ops = [(op, start, end) for op, start, end in zip(timeline.ops, timeline.start_ms, timeline.end_ms)]
    return "".join([
        (f'<g class="row{" slow-stage" if slow else ""}" data-stage="{int(stage_id)}" '
         f'transform="translate(0,{px(y_px)})">'),
        (f'<text class="lbl" y="{px(bar_top_px + geometry.bar_height_px / 2 + 4)}">'
         f"<title>{xml_text(_row_title(facts))}</title>{cells}</text>"),
        (f'<rect class="idle" x="{px(geometry.plot_left_px)}" y="{px(bar_top_px)}" '
         f'width="{px(makespan_ms * geometry.px_per_ms)}" height="{px(geometry.bar_height_px)}" '
         f'fill="{background}"{outline}/>'),
        f'<g class="plot" clip-path="url(#{CLIP_ID})">',
        f'<g class="ops" transform="translate(0,{px(bar_top_px)})">',
        *(_op(op, start, end, geometry) for op, start, end in ops),
        f'</g><g class="op-labels" transform="translate(0,{px(bar_top_px)})">',
        *(_op_label(op, start, end, geometry) for op, start, end in ops),
        "</g></g></g>",
    ])


def _op(op: str, start_ms: float, end_ms: float, geometry: Geometry) -> str:
    kind, chunk = op_kind(op), op_chunk(op)
    css = kind if chunk == 0 else f"{kind} c{chunk}"
    x_px, width_px = geometry.x_px(start_ms), (end_ms - start_ms) * geometry.px_per_ms
    name = xml_text(op)
    rect = (f'<rect class="{css}" data-op="{name}" x="{px(x_px)}" width="{px(width_px)}" '
            f'height="{px(geometry.bar_height_px)}"')
    if not width_px >= MIN_TITLE_WIDTH_PX:
        return rect + "/>"
    return rect + f"><title>{name} {ms_text(start_ms)}–{ms_text(end_ms)} ms</title></rect>"


def _op_label(op: str, start_ms: float, end_ms: float, geometry: Geometry) -> str:
    width_px = (end_ms - start_ms) * geometry.px_per_ms
    if not width_px >= len(op) * OP_CHAR_PX + 4:
        return ""
    text_class = "op dark" if op_kind(op) in DARK_TEXT_KINDS else "op"
    center_x_px, baseline_px = geometry.x_px(start_ms) + width_px / 2, geometry.bar_height_px / 2 + 3
    return f'<text class="{text_class}" x="{px(center_x_px)}" y="{px(baseline_px)}">{xml_text(op)}</text>'
