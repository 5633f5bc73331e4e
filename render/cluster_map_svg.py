"""Map of the cluster as an SVG: nodes as rows, GPUs as cells; its legend as data for the page to lay out.

A used GPU's hue says which replica it serves and its lightness which
stage (darker = earlier); cells large enough say it in text too ("r0·s1").
Unused GPUs are grey, failed ones dark with a cross. A slow GPU gets an
orange outline and a hatched corner: the rest of the cell keeps its
replica colour or the unused grey, so whether the slow GPU is used stays
visible. Every cell has a <title> tooltip. The plan carries no cluster
shape, so it is derived from the device ids: stages, unused and excluded
devices cover every GPU (API.md invariant 3).

The grid is laid out for a page about 1100 px wide: cells as large as
fit (up to 44 px), nodes wrapped into side-by-side columns when that
gives larger cells or keeps a large cluster from growing taller than the
page.

Slow GPUs come from `slow_speeds` when given, else the plan's
`slow_devices`. A plan stored before that field existed only carries each
stage's slowest `speed`: then a single-GPU slow stage marks its GPU exactly
and the GPUs of a larger slow stage get a dashed "in a slow stage" outline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from adapters.registry import ExportError
from cost_models.device import DeviceIdError, DeviceSpec
from render.markup import xml_text
from render.number_format import group_text, memory_text, px, speed_text
from wire.schemas import MAX_GPUS_PER_NODE, MAX_NODES, Plan, Stage

FONT = "system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', Arial, sans-serif"
UNUSED_COLOR = "#cfcfcf"
FAILED_COLOR = "#2b2b2b"
FAILED_CROSS_COLOR = "#ff6b5b"
SLOW_COLOR = "#e67e00"
GOLDEN_ANGLE_DEG = 137.508  # consecutive replicas get far-apart hues
TARGET_WIDTH_PX = 1100.0
TARGET_HEIGHT_PX = 420.0
MAX_CELL_PX = 44.0
MIN_CELL_PX = 5.0
MIN_TEXT_CELL_PX = 34.0  # "r12·s3" at 9 px fits from here
MIN_LABELLED_CELL_PX = 10.0  # below this nodes get no "n12" label; columns get a range header
HATCH_SHARE = 0.6  # legs of the hatched corner triangle, as a share of the cell
MARGIN_PX = 12.0
COLUMN_HEADER_PX = 12.0
HATCH_ID = "cm-hatch"  # one page may hold several SVGs: keep ids prefixed


class ClusterMapError(ExportError):
    """The plan's device ids do not describe a cluster the map can draw."""


@dataclass(frozen=True)
class Placement:
    """What one used GPU runs."""

    replica_id: int
    replica_index: int
    stage_index: int
    num_stages: int
    num_microbatches: int
    stage: Stage
    gpu_memory_gib: float | None


@dataclass(frozen=True)
class MapLayout:
    num_nodes: int
    gpus_per_node: int
    cell_px: float
    columns: int
    rows_per_column: int

    @property
    def gap_px(self) -> float:
        return 2.0 if self.cell_px >= MIN_LABELLED_CELL_PX else 1.0

    @property
    def label_px(self) -> float:
        if self.cell_px < MIN_LABELLED_CELL_PX:
            return 0.0
        return (len(str(max(self.num_nodes - 1, 0))) + 1) * 6.5 + 8

    @property
    def header_px(self) -> float:
        return 0.0 if self.label_px else COLUMN_HEADER_PX

    @property
    def node_width_px(self) -> float:
        return self.label_px + self.gpus_per_node * (self.cell_px + self.gap_px)

    @property
    def column_width_px(self) -> float:
        return self.node_width_px + min(3 * self.cell_px, 24.0)

    def node_origin_px(self, node: int) -> tuple[float, float]:
        column, row = divmod(node, self.rows_per_column)
        return (MARGIN_PX + column * self.column_width_px,
                MARGIN_PX + self.header_px + row * (self.cell_px + self.gap_px))

    @property
    def size_px(self) -> tuple[float, float]:
        return (2 * MARGIN_PX + self.columns * self.column_width_px,
                2 * MARGIN_PX + self.header_px + self.rows_per_column * (self.cell_px + self.gap_px))


@dataclass(frozen=True)
class MapLegend:
    """What the map's legend has to explain; the page lays it out in HTML, where it can wrap."""

    headline: str
    replicas: tuple[tuple[int, str], ...]  # (replica id, its hue at stage 0)
    stage_shades: tuple[str, ...]
    has_failed: bool
    has_slow: bool
    has_slow_stage: bool


def parse_device(device: str) -> tuple[int, int | None]:
    """(node, gpu or None for "n:*"); an id that is not a device of a drawable cluster is a ClusterMapError."""
    try:
        spec = DeviceSpec.parse(device)
    except DeviceIdError:
        raise ClusterMapError(f"device id {device!r} is not of the form \"<node>:<gpu>\"") from None
    if spec.node >= MAX_NODES or (spec.gpu is not None and spec.gpu >= MAX_GPUS_PER_NODE):
        raise ClusterMapError(f"device id {device!r} is outside the largest cluster resiplan plans "
                              f"({MAX_NODES} nodes of {MAX_GPUS_PER_NODE} GPUs)")
    return spec.node, spec.gpu


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
            placement = Placement(replica.id, replica_index, stage_index, len(replica.stages),
                                  replica.num_microbatches, stage, plan.gpu_memory_gib)
            for device in stage.devices:
                out[device] = placement
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
    """The largest cells that fit TARGET_WIDTH_PX, over every number of side-by-side node columns.

    Cells also shrink to keep the map within TARGET_HEIGHT_PX; once they are at MIN_CELL_PX, more
    columns keep a large cluster's map from growing taller than needed. Ties go to fewer columns.
    """
    num_nodes = max(num_nodes, 1)
    best: tuple[tuple[float, float], MapLayout] | None = None
    for columns in range(1, num_nodes + 1):
        rows = math.ceil(num_nodes / columns)
        if columns > 1 and math.ceil(num_nodes / (columns - 1)) == rows:
            continue  # same rows with fewer columns: never better
        cell_px = _widest_cell_px(num_nodes, gpus_per_node, columns, rows)
        if cell_px is None:
            break  # even the smallest cells no longer fit side by side
        layout = MapLayout(num_nodes, gpus_per_node, cell_px, columns, rows)
        overflow_px = max(0.0, layout.size_px[1] - TARGET_HEIGHT_PX)
        score = (cell_px, -overflow_px)
        if best is None or score > best[0]:
            best = (score, layout)
    return best[1] if best is not None else MapLayout(num_nodes, gpus_per_node, MIN_CELL_PX, 1, num_nodes)


def _widest_cell_px(num_nodes: int, gpus_per_node: int, columns: int, rows: int) -> float | None:
    """The largest whole-pixel cell, within the height target when possible, whose columns fit the width."""
    for cell_px in range(int(MAX_CELL_PX), int(MIN_CELL_PX) - 1, -1):
        layout = MapLayout(num_nodes, gpus_per_node, float(cell_px), columns, rows)
        width_px, height_px = layout.size_px
        if width_px <= TARGET_WIDTH_PX and (height_px <= TARGET_HEIGHT_PX or cell_px == MIN_CELL_PX):
            return float(cell_px)
    wide_enough = MapLayout(num_nodes, gpus_per_node, MIN_CELL_PX, columns, rows).size_px[0] <= TARGET_WIDTH_PX
    return MIN_CELL_PX if wide_enough or columns == 1 else None


def replica_color(replica_index: int, stage_index: int, num_stages: int) -> str:
    hue = (replica_index * GOLDEN_ANGLE_DEG) % 360
    lightness = 32 + 40 * stage_index / max(num_stages - 1, 1)
    return f"hsl({hue:.0f},62%,{lightness:.0f}%)"


def _text_color(stage_index: int, num_stages: int) -> str:
    lightness = 32 + 40 * stage_index / max(num_stages - 1, 1)
    return "#111" if lightness >= 55 else "#fff"


def render(plan: Plan, slow_speeds: Mapping[str, float] | None = None) -> str:
    return cluster_map_svg(plan, slow_speeds)


def map_legend(plan: Plan, slow_speeds: Mapping[str, float] | None = None) -> MapLegend:
    num_nodes, gpus_per_node = cluster_shape(plan)
    slow, in_slow_stage = slow_marks(plan, slow_speeds)
    used = sum(len(s.devices) for r in plan.replicas for s in r.stages)
    headline = (f"{num_nodes} nodes × {gpus_per_node} GPUs · {used} used in {len(plan.replicas)} replicas · "
                f"{len(plan.unused_devices)} unused · {len(plan.excluded_devices)} failed")
    return MapLegend(
        headline=headline,
        replicas=tuple((replica.id, replica_color(index, 0, 1)) for index, replica in enumerate(plan.replicas)),
        stage_shades=tuple(replica_color(0, i, 6) for i in range(6)),
        has_failed=bool(plan.excluded_devices),
        has_slow=bool(slow),
        has_slow_stage=bool(in_slow_stage),
    )


def cluster_map_svg(plan: Plan, slow_speeds: Mapping[str, float] | None = None) -> str:
    num_nodes, gpus_per_node = cluster_shape(plan)
    layout = layout_for(num_nodes, gpus_per_node)
    placed = placements(plan)
    failed = failed_devices(plan, gpus_per_node)
    slow, in_slow_stage = slow_marks(plan, slow_speeds)
    width_px, height_px = layout.size_px
    parts = [
        (f'<svg xmlns="http://www.w3.org/2000/svg" class="cluster-map" width="{px(width_px)}" '
         f'height="{px(height_px)}" viewBox="0 0 {px(width_px)} {px(height_px)}" font-family="{xml_text(FONT)}" '
         'font-size="11" role="img">'),
        f"<desc>{xml_text(map_legend(plan, slow_speeds).headline)}</desc>",
        _defs(layout.cell_px),
        '<rect width="100%" height="100%" fill="#ffffff"/>',
    ]
    if not layout.label_px:
        parts.append(_column_headers(layout))
    for node in range(num_nodes):
        parts.append(_node(node, layout, placed, failed, slow, in_slow_stage))
    parts.append("</svg>\n")
    return "\n".join(parts)


def _defs(cell_px: float) -> str:
    stripe_px = 4 if cell_px >= 16 else 3
    return (
        f'<defs><pattern id="{HATCH_ID}" width="{stripe_px}" height="{stripe_px}" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="{stripe_px * 0.45:.2f}" height="{stripe_px}" '
        f'fill="{SLOW_COLOR}"/></pattern></defs>'
        "<style>"  # scoped: inline in an HTML page, an SVG's <style> applies to the whole page
        f"svg.cluster-map .slow{{stroke:{SLOW_COLOR};stroke-width:2}}"
        f"svg.cluster-map .slow-stage{{stroke:{SLOW_COLOR};stroke-width:1;stroke-dasharray:2 1}}"
        f"svg.cluster-map .x{{stroke:{FAILED_CROSS_COLOR};stroke-width:1.2}}"
        "svg.cluster-map .node-label{font-size:10px;fill:#555;text-anchor:end}"
        "svg.cluster-map .cell-text{font-size:9px;text-anchor:middle;pointer-events:none}"
        "</style>"
    )


def _column_headers(layout: MapLayout) -> str:
    """Cells too small for a label on every node: say which nodes each column holds."""
    parts = []
    for column in range(layout.columns):
        first = column * layout.rows_per_column
        last = min(first + layout.rows_per_column, layout.num_nodes) - 1
        if first > last:
            break
        x_px, y_px = layout.node_origin_px(first)
        parts.append(f'<text class="column-label" x="{px(x_px)}" y="{px(y_px - 4)}" font-size="9" fill="#555">'
                     f'n{first}–{last}</text>')
    return "".join(parts)


def _node(node: int, layout: MapLayout, placed: Mapping[str, Placement], failed: set[str],
          slow: Mapping[str, float], in_slow_stage: Mapping[str, float]) -> str:
    x_px, y_px = layout.node_origin_px(node)
    parts = [f'<g class="node" data-node="{node}" transform="translate({px(x_px)},{px(y_px)})">']
    if layout.label_px:
        parts.append(f'<text class="node-label" x="{px(layout.label_px - 6)}" '
                     f'y="{px(layout.cell_px / 2 + 3.5)}">n{node}</text>')
    for gpu in range(layout.gpus_per_node):
        device = f"{node}:{gpu}"
        parts.append(_cell(device, layout.label_px + gpu * (layout.cell_px + layout.gap_px), layout.cell_px,
                           placed.get(device), failed, slow, in_slow_stage))
    parts.append("</g>")
    return "".join(parts)


def _cell(device: str, x_px: float, cell_px: float, placement: Placement | None, failed: set[str],
          slow: Mapping[str, float], in_slow_stage: Mapping[str, float]) -> str:
    classes, notes, text_color = ["gpu"], [], "#111"
    if device in failed:
        classes.append("failed")
        fill, notes = FAILED_COLOR, ["failed"]
    elif placement is not None:
        classes.append("used")
        fill = replica_color(placement.replica_index, placement.stage_index, placement.num_stages)
        text_color = _text_color(placement.stage_index, placement.num_stages)
        stage = placement.stage
        notes = [f"replica {placement.replica_id}", f"stage {stage.id}",
                 f"layers [{stage.layers[0]}, {stage.layers[1]})", group_text(stage.tp, stage.cp),
                 f"{placement.num_microbatches} microbatches",
                 f"memory {memory_text(stage.memory_gib, placement.gpu_memory_gib)}"]
    else:
        classes.append("unused")
        fill, notes = UNUSED_COLOR, ["unused"]
    speed_attr = ""
    is_slow = device in slow and device not in failed
    if is_slow:
        classes.append("slow")
        notes.append(f"slow ×{speed_text(slow[device])}")
        speed_attr = f' data-speed="{speed_text(slow[device])}"'
    elif device in in_slow_stage and device not in failed:
        classes.append("slow-stage")
        notes.append(f"in a stage slowed to ×{speed_text(in_slow_stage[device])}")
    title = xml_text(" · ".join([device, *notes]))
    size = px(cell_px)
    cell = (f'<rect class="{" ".join(classes)}" data-device="{xml_text(device)}"{speed_attr} x="{px(x_px)}" '
            f'width="{size}" height="{size}" fill="{fill}"><title>{title}</title></rect>')
    if "failed" in classes:
        inset = 2.0 if cell_px >= 8 else 1.0
        far = cell_px - inset
        cell += (f'<path class="x" d="M{px(x_px + inset)} {px(inset)}L{px(x_px + far)} {px(far)}'
                 f'M{px(x_px + far)} {px(inset)}L{px(x_px + inset)} {px(far)}"/>')
    if is_slow:
        # A hatched corner, not a hatched cell: the rest keeps the replica colour (or unused grey).
        leg = cell_px * HATCH_SHARE
        cell += (f'<path class="hatch" d="M{px(x_px)} 0h{px(leg)}L{px(x_px)} {px(leg)}z" fill="url(#{HATCH_ID})" '
                 'pointer-events="none"/>')
    if cell_px >= MIN_TEXT_CELL_PX:
        cell += _cell_text(x_px, cell_px, placement if "used" in classes else None,
                           slow.get(device) if is_slow else None, text_color)
    return cell


def _cell_text(x_px: float, cell_px: float, placement: Placement | None, slow_speed: float | None,
               color: str) -> str:
    """What a large cell says without hovering: "r0·s1", and the speed of a slow GPU."""
    lines = []
    if placement is not None:
        lines.append(f"r{placement.replica_id}·s{placement.stage.id}")
    if slow_speed is not None:
        lines.append(f"×{speed_text(slow_speed)}")
    if not lines:
        return ""
    center_px = x_px + cell_px / 2
    first_baseline_px = cell_px / 2 + 3.5 - 5.5 * (len(lines) - 1) + (4 if slow_speed is not None else 0)
    return "".join(
        f'<text class="cell-text" x="{px(center_px)}" y="{px(first_baseline_px + 11 * i)}" fill="{color}">'
        f"{xml_text(line)}</text>"
        for i, line in enumerate(lines)
    )

