"""Map of the cluster as a self-contained SVG: nodes as rows, GPUs as cells.

A used GPU's hue says which replica it serves and its lightness which
stage (darker = earlier). Unused GPUs are grey, failed ones dark with a
cross, slow ones hatched with an orange outline. Every cell has a <title>
tooltip. The plan carries no cluster shape, so it is derived from the
device ids: stages, unused and excluded devices cover every GPU (API.md
invariant 3).

Slow GPUs come from `slow_speeds` when given, else the plan's
`slow_devices`. A plan stored before that field existed only carries each
stage's slowest `speed`: then a single-GPU slow stage marks its GPU exactly
and the GPUs of a larger slow stage get a dashed "in a slow stage" outline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from api.schemas import Plan, Stage

FONT = "system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', Arial, sans-serif"
UNUSED_COLOR = "#cfcfcf"
FAILED_COLOR = "#2b2b2b"
FAILED_CROSS_COLOR = "#ff6b5b"
SLOW_COLOR = "#e67e00"
GOLDEN_ANGLE_DEG = 137.508  # consecutive replicas get far-apart hues
MAX_WIDTH_PX = 1200.0
MAX_ROWS_PER_COLUMN = 64
LEGEND_HEIGHT_PX = 78.0
LEGEND_CHAR_PX = 6.2  # 11 px sans advance, for placing legend items
MARGIN_PX = 12.0
HATCH_ID = "cm-hatch"  # one page may hold several SVGs: keep ids prefixed


@dataclass(frozen=True)
class Placement:
    """What one used GPU runs."""

    replica_id: int
    replica_index: int
    stage_index: int
    num_stages: int
    stage: Stage


@dataclass(frozen=True)
class MapLayout:
    num_nodes: int
    gpus_per_node: int
    cell_px: float
    gap_px: float
    label_px: float
    columns: int
    rows_per_column: int

    @property
    def node_width_px(self) -> float:
        return self.label_px + self.gpus_per_node * (self.cell_px + self.gap_px)

    @property
    def column_width_px(self) -> float:
        return self.node_width_px + 3 * self.cell_px

    def node_origin_px(self, node: int) -> tuple[float, float]:
        column, row = divmod(node, self.rows_per_column)
        return (MARGIN_PX + column * self.column_width_px,
                MARGIN_PX + LEGEND_HEIGHT_PX + row * (self.cell_px + self.gap_px))

    @property
    def size_px(self) -> tuple[float, float]:
        return (2 * MARGIN_PX + self.columns * self.column_width_px,
                2 * MARGIN_PX + LEGEND_HEIGHT_PX + self.rows_per_column * (self.cell_px + self.gap_px))


def parse_device(device: str) -> tuple[int, int | None]:
    node, _, gpu = device.partition(":")
    return int(node), (None if gpu == "*" else int(gpu))


def cluster_shape(plan: Plan) -> tuple[int, int]:
    """(num_nodes, gpus_per_node) from the highest node and GPU ids the plan mentions."""
    devices = [d for r in plan.replicas for s in r.stages for d in s.devices]
    devices += plan.unused_devices + plan.excluded_devices
    parsed = [parse_device(d) for d in devices]
    num_nodes = max((n for n, _ in parsed), default=-1) + 1
    gpus_per_node = max((g for _, g in parsed if g is not None), default=0) + 1
    return num_nodes, gpus_per_node


def placements(plan: Plan) -> dict[str, Placement]:
    out = {}
    for replica_index, replica in enumerate(plan.replicas):
        for stage_index, stage in enumerate(replica.stages):
            for device in stage.devices:
                out[device] = Placement(replica.id, replica_index, stage_index, len(replica.stages), stage)
    return out


def failed_devices(plan: Plan, gpus_per_node: int) -> set[str]:
    """Excluded devices, with a whole-node "3:*" expanded to its GPUs."""
    out = set()
    for device in plan.excluded_devices:
        node, gpu = parse_device(device)
        out.update(f"{node}:{g}" for g in range(gpus_per_node)) if gpu is None else out.add(f"{node}:{gpu}")
    return out


def slow_marks(plan: Plan, slow_speeds: Mapping[str, float] | None) -> tuple[dict[str, float], dict[str, float]]:
    """(exactly known slow GPUs -> speed, GPUs only known to sit in a slow stage -> the stage's speed)."""
    if slow_speeds is None and plan.slow_devices:
        slow_speeds = {slow.device: slow.speed for slow in plan.slow_devices}
    if slow_speeds is not None:
        return {d: s for d, s in slow_speeds.items() if s < 1.0}, {}
    exact, in_slow_stage = {}, {}
    for replica in plan.replicas:
        for stage in replica.stages:
            if stage.speed < 1.0:
                target = exact if len(stage.devices) == 1 else in_slow_stage
                target.update((device, stage.speed) for device in stage.devices)
    return exact, in_slow_stage


def layout_for(num_nodes: int, gpus_per_node: int) -> MapLayout:
    """Cells shrink with the cluster; past 64 nodes the rows wrap into side-by-side columns."""
    cell_px = 18.0 if num_nodes <= 16 else 14.0 if num_nodes <= 64 else 10.0 if num_nodes <= 256 else 6.0
    if gpus_per_node > 16:
        cell_px = min(cell_px, 10.0)
    gap_px = 2.0 if cell_px >= 10 else 1.0
    label_px = (len(str(max(num_nodes - 1, 0))) + 2) * 6.5 + 6 if cell_px >= 10 else 0.0
    probe = MapLayout(num_nodes, gpus_per_node, cell_px, gap_px, label_px, 1, max(num_nodes, 1))
    fit = max(1, int((MAX_WIDTH_PX - 2 * MARGIN_PX) // probe.column_width_px))
    columns = max(1, min(fit, math.ceil(num_nodes / MAX_ROWS_PER_COLUMN)))
    rows_per_column = max(1, math.ceil(num_nodes / columns))
    return MapLayout(num_nodes, gpus_per_node, cell_px, gap_px, label_px, columns, rows_per_column)


def replica_color(replica_index: int, stage_index: int, num_stages: int) -> str:
    hue = (replica_index * GOLDEN_ANGLE_DEG) % 360
    lightness = 32 + 40 * stage_index / max(num_stages - 1, 1)
    return f"hsl({hue:.0f},62%,{lightness:.0f}%)"


def render(plan: Plan, slow_speeds: Mapping[str, float] | None = None) -> str:
    return cluster_map_svg(plan, slow_speeds)


def cluster_map_svg(plan: Plan, slow_speeds: Mapping[str, float] | None = None) -> str:
    num_nodes, gpus_per_node = cluster_shape(plan)
    layout = layout_for(num_nodes, gpus_per_node)
    placed = placements(plan)
    failed = failed_devices(plan, gpus_per_node)
    slow, in_slow_stage = slow_marks(plan, slow_speeds)
    legend, legend_width_px = _legend(plan, num_nodes, gpus_per_node, bool(slow), bool(in_slow_stage), bool(failed))
    width_px, height_px = layout.size_px
    width_px = max(width_px, legend_width_px + MARGIN_PX)
    parts = [
        (f'<svg xmlns="http://www.w3.org/2000/svg" class="cluster-map" width="{_n(width_px)}" '
         f'height="{_n(height_px)}" viewBox="0 0 {_n(width_px)} {_n(height_px)}" font-family={quoteattr(FONT)} '
         'font-size="11">'),
        _defs(),
        '<rect width="100%" height="100%" fill="#ffffff"/>',
        legend,
    ]
    if not layout.label_px:
        parts.append(_column_headers(layout))
    for node in range(num_nodes):
        parts.append(_node(node, layout, placed, failed, slow, in_slow_stage))
    parts.append("</svg>\n")
    return "\n".join(parts)


def _n(value: float) -> str:
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def _speed(speed: float) -> str:
    return f"{speed:.2f}".rstrip("0").rstrip(".")


def _defs() -> str:
    return (
        f'<defs><pattern id="{HATCH_ID}" width="4" height="4" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="1.6" height="4" fill="{SLOW_COLOR}"/></pattern></defs>'
        "<style>"  # scoped: inline in an HTML page, an SVG's <style> applies to the whole page
        f"svg.cluster-map .slow{{stroke:{SLOW_COLOR};stroke-width:1.5}}"
        f"svg.cluster-map .slow-stage{{stroke:{SLOW_COLOR};stroke-width:1;stroke-dasharray:2 1}}"
        f"svg.cluster-map .x{{stroke:{FAILED_CROSS_COLOR};stroke-width:1.2}}"
        "svg.cluster-map .node-label{font-size:10px;fill:#555;text-anchor:end}"
        "</style>"
    )


def _legend(plan: Plan, num_nodes: int, gpus_per_node: int, has_slow: bool, has_slow_stage: bool,
            has_failed: bool) -> tuple[str, float]:
    """The legend and how wide it is, so a small cluster's map is not narrower than its legend."""
    used = sum(len(s.devices) for r in plan.replicas for s in r.stages)
    headline = (f"Cluster: {num_nodes} nodes × {gpus_per_node} GPUs · "
                f"{used} used in {len(plan.replicas)} replicas · "
                f"{len(plan.unused_devices)} unused · {len(plan.excluded_devices)} failed")
    parts = [(f'<g class="legend"><text x="{_n(MARGIN_PX)}" y="{_n(MARGIN_PX + 10)}" font-size="13" '
              f'font-weight="bold">{escape(headline)}</text>')]
    widest_px = MARGIN_PX + len(headline) * 7.4
    x_px, y_px = MARGIN_PX, MARGIN_PX + 24
    swatches = [(f'fill="{replica_color(i, 0, 1)}"', f"replica {r.id}") for i, r in enumerate(plan.replicas[:8])]
    if len(plan.replicas) > 8:
        swatches.append(('fill="none"', f"… {len(plan.replicas) - 8} more (hue = replica)"))
    for paint, name in swatches:
        parts.append(_swatch(x_px, y_px, paint, name))
        x_px += 22 + len(name) * LEGEND_CHAR_PX + 12
    widest_px = max(widest_px, x_px)
    x_px, y_px = MARGIN_PX, y_px + 20
    gradient = "".join(
        f'<rect x="{_n(x_px + i * 5)}" y="{_n(y_px)}" width="5" height="12" '
        f'fill="{replica_color(0, i, 6)}"/>' for i in range(6)
    )
    parts.append(gradient + f'<text x="{_n(x_px + 36)}" y="{_n(y_px + 10)}">stage: darker = earlier</text>')
    x_px += 36 + 23 * LEGEND_CHAR_PX + 16
    items = [(f'fill="{UNUSED_COLOR}"', "unused")]
    if has_failed:
        items.append((f'fill="{FAILED_COLOR}"', "failed ×"))
    if has_slow:
        items.append((f'fill="url(#{HATCH_ID})" class="slow"', "slow GPU"))
    if has_slow_stage:
        items.append(('fill="#ffffff" class="slow-stage"', "in a slow stage"))
    for paint, name in items:
        parts.append(_swatch(x_px, y_px, paint, name))
        x_px += 22 + len(name) * LEGEND_CHAR_PX + 12
    parts.append("</g>")
    return "".join(parts), max(widest_px, x_px)


def _column_headers(layout: MapLayout) -> str:
    """Cells too small for a label on every node: say which nodes each column holds."""
    parts = []
    for column in range(layout.columns):
        first = column * layout.rows_per_column
        last = min(first + layout.rows_per_column, layout.num_nodes) - 1
        if first > last:
            break
        x_px, y_px = layout.node_origin_px(first)
        parts.append(f'<text class="column-label" x="{_n(x_px)}" y="{_n(y_px - 4)}" font-size="9" fill="#555">'
                     f'n{first}–{last}</text>')
    return "".join(parts)


def _swatch(x_px: float, y_px: float, paint: str, name: str) -> str:
    return (f'<rect x="{_n(x_px)}" y="{_n(y_px)}" width="14" height="12" {paint}/>'
            f'<text x="{_n(x_px + 19)}" y="{_n(y_px + 10)}">{escape(name)}</text>')


def _node(node: int, layout: MapLayout, placed: Mapping[str, Placement], failed: set[str],
          slow: Mapping[str, float], in_slow_stage: Mapping[str, float]) -> str:
    x_px, y_px = layout.node_origin_px(node)
    parts = [f'<g class="node" data-node="{node}" transform="translate({_n(x_px)},{_n(y_px)})">']
    if layout.label_px:
        parts.append(f'<text class="node-label" x="{_n(layout.label_px - 6)}" y="{_n(layout.cell_px - 3)}">'
                     f"n{node}</text>")
    for gpu in range(layout.gpus_per_node):
        parts.append(_cell(f"{node}:{gpu}", layout.label_px + gpu * (layout.cell_px + layout.gap_px), layout.cell_px,
                           placed.get(f"{node}:{gpu}"), failed, slow, in_slow_stage))
    parts.append("</g>")
    return "".join(parts)


def _cell(device: str, x_px: float, cell_px: float, placement: Placement | None, failed: set[str],
          slow: Mapping[str, float], in_slow_stage: Mapping[str, float]) -> str:
    classes, notes = ["gpu"], []
    if device in failed:
        classes.append("failed")
        fill, notes = FAILED_COLOR, ["failed"]
    elif placement is not None:
        classes.append("used")
        fill = replica_color(placement.replica_index, placement.stage_index, placement.num_stages)
        stage = placement.stage
        notes = [f"replica {placement.replica_id}", f"stage {stage.id}",
                 f"layers [{stage.layers[0]}, {stage.layers[1]})", f"TP {stage.tp}"]
    else:
        classes.append("unused")
        fill, notes = UNUSED_COLOR, ["unused"]
    speed_attr = ""
    if device in slow and device not in failed:
        classes.append("slow")
        notes.append(f"slow ×{_speed(slow[device])}")
        speed_attr = f' data-speed="{_speed(slow[device])}"'
    elif device in in_slow_stage and device not in failed:
        classes.append("slow-stage")
        notes.append(f"in a stage slowed to ×{_speed(in_slow_stage[device])}")
    title = escape(" · ".join([device, *notes]))
    size = _n(cell_px)
    cell = (f'<rect class="{" ".join(classes)}" data-device="{device}"{speed_attr} x="{_n(x_px)}" '
            f'width="{size}" height="{size}" fill="{fill}"><title>{title}</title></rect>')
    if "failed" in classes:
        inset, far = 2.0 if cell_px >= 8 else 1.0, cell_px - (2.0 if cell_px >= 8 else 1.0)
        cell += (f'<path class="x" d="M{_n(x_px + inset)} {_n(inset)}L{_n(x_px + far)} {_n(far)}'
                 f'M{_n(x_px + far)} {_n(inset)}L{_n(x_px + inset)} {_n(far)}"/>')
    if "slow" in classes:
        # Hatching on top of the replica colour: both stay visible; the title keeps the tooltip.
        cell += (f'<rect x="{_n(x_px)}" width="{size}" height="{size}" fill="url(#{HATCH_ID})" '
                 f'pointer-events="none"/>')
    return cell
