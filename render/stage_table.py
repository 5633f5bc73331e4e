"""The plan page's table: one row per stage of every replica, with what the planner decided for it.

Columns: replica (in its cluster-map hue, linking to its timeline), microbatches, stage, devices,
TP, layers, memory used / the GPU's capacity, forward and backward ms per microbatch, speed. Past
MAX_LISTED_REPLICAS replicas, replicas alike in everything but their devices share one group of
rows (devices shown for the first of them), and the table stops at MAX_ROWS stage rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from render.cluster_map_svg import replica_color
from render.gantt_svg import device_range
from render.markup import html_text
from render.number_format import memory_share, memory_text, ms_text, speed_text
from wire.schemas import Plan, Replica

MAX_LISTED_REPLICAS = 16
MAX_ROWS = 1024
FULL_MEMORY_SHARE = 0.95  # a bar this full is drawn in the warning colour


@dataclass(frozen=True)
class ReplicaGroup:
    """Replicas that differ only in their devices (or one replica), in the plan's order."""

    replicas: tuple[Replica, ...]
    color: str


def replica_groups(plan: Plan) -> list[ReplicaGroup]:
    colors = {replica.id: replica_color(index, 0, 1) for index, replica in enumerate(plan.replicas)}
    if len(plan.replicas) <= MAX_LISTED_REPLICAS:
        return [ReplicaGroup((replica,), colors[replica.id]) for replica in plan.replicas]
    groups: dict[tuple, list[Replica]] = {}
    for replica in plan.replicas:
        groups.setdefault(_shape(replica), []).append(replica)
    return [ReplicaGroup(tuple(members), colors[members[0].id]) for members in groups.values()]


def _shape(replica: Replica) -> tuple:
    return replica.num_microbatches, tuple(
        (s.tp, s.cp, tuple(s.layers), s.memory_gib, s.forward_ms, s.backward_ms, s.speed) for s in replica.stages
    )


def replica_label(ids: list[int]) -> str:
    if len(ids) == 1:
        return f"replica {ids[0]}"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"replicas {ids[0]}–{ids[-1]}"
    return f"replicas {', '.join(map(str, ids[:4]))}{' …' if len(ids) > 4 else ''} ({len(ids)})"


def stage_table_html(plan: Plan, shown_replica_ids: frozenset[int], timeline_href: Callable[[int], str | None],
                     slow_speeds: Mapping[str, float]) -> str:
    """The table; `timeline_href(replica_id)` is the escaped link to that replica's Gantt chart, or None."""
    capacity_gib = plan.gpu_memory_gib
    head = ('<thead><tr><th>Replica</th><th class="num">Micro&shy;batches</th><th class="num">Stage</th>'
            '<th>Devices</th><th class="num" title="tensor-parallel size (× context-parallel size)">TP</th><th>Layers</th><th>Memory used / capacity</th>'
            '<th class="num">Forward ms</th><th class="num">Backward ms</th><th>Speed</th></tr></thead>')
    body, rows = [], 0
    groups = replica_groups(plan)
    for group_index, group in enumerate(groups):
        first = group.replicas[0]
        if rows + max(len(first.stages), 1) > MAX_ROWS:
            left_out = sum(len(g.replicas) for g in groups[group_index:])
            body.append(f'<tr class="more"><td colspan="10">… {left_out} more replicas: see the plan JSON.</td></tr>')
            break
        body.append(_group_rows(group, group.replicas[0].id in shown_replica_ids, timeline_href, capacity_gib,
                                slow_speeds))
        rows += max(len(first.stages), 1)
    note = ""
    if capacity_gib is None:
        note = ('<p class="explain">This plan does not record its GPUs\' memory capacity (it was planned before '
                "resiplan stored it): memory shows what each stage uses.</p>")
    return f'<table class="stages">{head}<tbody>{"".join(body)}</tbody></table>{note}'


def _group_rows(group: ReplicaGroup, shown: bool, timeline_href: Callable[[int], str | None],
                capacity_gib: float | None, slow_speeds: Mapping[str, float]) -> str:
    first = group.replicas[0]
    ids = [replica.id for replica in group.replicas]
    span = max(len(first.stages), 1)
    label = html_text(replica_label(ids))
    href = timeline_href(first.id)
    name = f'<a href="{href}">{label}</a>' if href is not None and not shown else label
    if shown:
        name += '<br><span class="tag">in the chart below</span>'
    if len(group.replicas) > 1:
        name += f'<br><span class="hint">devices of replica {first.id}</span>'
    replica_cell = (f'<th scope="rowgroup" rowspan="{span}" class="replica"><span class="chip" '
                    f'style="background:{group.color}"></span>{name}</th>'
                    f'<td rowspan="{span}" class="num microbatches">{first.num_microbatches}</td>')
    group_class = "group shown" if shown else "group"
    if not first.stages:
        return f'<tr class="{group_class}" data-replica="{first.id}">{replica_cell}<td colspan="8">no stages</td></tr>'
    rows = []
    for index, stage in enumerate(first.stages):
        slow = stage.speed < 1.0 or any(slow_speeds.get(device, 1.0) < 1.0 for device in stage.devices)
        classes = " ".join(c for c in (group_class if index == 0 else "", "slow" if slow else "") if c)
        rows.append(
            f'<tr class="{classes}" data-replica="{first.id}" data-stage="{stage.id}">'
            f"{replica_cell if index == 0 else ''}"
            f'<td class="num">{stage.id}</td>'
            f'<td class="devices" title="{html_text(", ".join(stage.devices))}">'
            f"{html_text(device_range(stage.devices))}</td>"
            f'<td class="num">{stage.tp}{f" × {int(stage.cp)}" if stage.cp > 1 else ""}</td>'
            f'<td class="layers">[{stage.layers[0]}, {stage.layers[1]}) <span class="hint">'
            f"{_count(stage.layers[1] - stage.layers[0], 'layer')}</span></td>"
            f'<td class="memory-cell">{_memory_cell(stage.memory_gib, capacity_gib)}</td>'
            f'<td class="num">{ms_text(round(stage.forward_ms, 1))}</td>'
            f'<td class="num">{ms_text(round(stage.backward_ms, 1))}</td>'
            f'<td class="speed">{_speed_cell(stage.speed, stage.devices, slow_speeds)}</td></tr>'
        )
    return "".join(rows)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _memory_cell(used_gib: float, capacity_gib: float | None) -> str:
    share = memory_share(used_gib, capacity_gib)
    text = html_text(memory_text(used_gib, capacity_gib))
    if share is None:
        return f'<span class="memory">{text}</span>'
    full = " full" if share >= FULL_MEMORY_SHARE else ""
    return (f'<span class="memory"><span class="bar{full}" title="{share * 100:.0f} % of the GPU\'s memory">'
            f'<span style="width:{share * 100:.1f}%"></span></span>{text}</span>')


def _speed_cell(speed: float, devices: list[str], slow_speeds: Mapping[str, float]) -> str:
    slow_devices = [f"{device} ×{speed_text(slow_speeds[device])}" for device in devices
                    if slow_speeds.get(device, 1.0) < 1.0]
    if speed >= 1.0 and not slow_devices:
        return "×1"
    # Which member is slow, when the stage has several.
    detail = ""
    if len(devices) > 1 and slow_devices:
        detail = f'<br><span class="hint">{html_text(", ".join(slow_devices))}</span>'
    return f'<strong class="slow-speed">×{speed_text(speed)}</strong> slow{detail}'
