"""The cluster map: one cell per GPU, failed/slow/unused marks on exactly the right GPUs."""

from __future__ import annotations

import re

import pytest

from render.cluster_map_svg import (
    MAX_CELL_PX,
    TARGET_WIDTH_PX,
    UNUSED_COLOR,
    ClusterMapError,
    cluster_map_svg,
    cluster_shape,
    layout_for,
    map_legend,
    replica_color,
)
from tests.ui.plans import FAILED, SLOW_SPEEDS, UNUSED, huge_cluster_plan, small_plan
from tests.ui.svg_support import SVG, classes, find_class, parse_svg, text_of

ALL_DEVICES = {f"{n}:{g}" for n in range(3) for g in range(4)}


def _cells(root):
    return {rect.get("data-device"): rect for rect in find_class(root, "rect", "gpu")}


def _marked(root, mark):
    return {device for device, rect in _cells(root).items() if mark in classes(rect)}


@pytest.fixture(scope="module")
def plan():
    return small_plan()


def test_one_cell_per_device_in_node_rows(plan):
    root = parse_svg(cluster_map_svg(plan, SLOW_SPEEDS))
    assert cluster_shape(plan) == (3, 4)
    nodes = find_class(root, "g", "node")
    assert [int(n.get("data-node")) for n in nodes] == [0, 1, 2]
    for node in nodes:
        expected = [f"{node.get('data-node')}:{g}" for g in range(4)]
        assert [r.get("data-device") for r in find_class(node, "rect", "gpu")] == expected
    assert set(_cells(root)) == ALL_DEVICES
    assert len(find_class(root, "rect", "gpu")) == len(ALL_DEVICES)


def test_failed_unused_and_slow_marks_on_exactly_the_right_devices(plan):
    root = parse_svg(cluster_map_svg(plan, SLOW_SPEEDS))
    assert _marked(root, "failed") == set(FAILED)
    assert _marked(root, "unused") == set(UNUSED)
    assert _marked(root, "slow") == set(SLOW_SPEEDS)  # includes the unused slow 2:2
    assert _marked(root, "slow-stage") == set()
    assert _marked(root, "used") == ALL_DEVICES - set(FAILED) - set(UNUSED)
    cells = _cells(root)
    assert {d: float(cells[d].get("data-speed")) for d in SLOW_SPEEDS} == SLOW_SPEEDS
    # A failed cell is crossed out: one cross per failed device.
    assert len(find_class(root, "path", "x")) == len(FAILED)


def test_without_request_speeds_slow_stages_mark_what_the_plan_knows(plan):
    """A 1-GPU slow stage names its GPU; members of a bigger slow stage are only 'in a slow stage'."""
    root = parse_svg(cluster_map_svg(plan, None))
    assert _marked(root, "slow") == {"2:0"}
    assert _marked(root, "slow-stage") == {"0:2", "0:3"}
    assert "in a stage slowed to ×0.5" in text_of(_cells(root)["0:3"].find(f"{SVG}title"))


def test_tooltips_name_device_replica_stage_layers_tp(plan):
    cells = _cells(parse_svg(cluster_map_svg(plan, SLOW_SPEEDS)))
    expected = "0:3 · replica 0 · stage 1 · layers [8, 16) · TP 2 · 8 microbatches · memory 40.0 / 80 GiB · slow ×0.5"
    assert text_of(cells["0:3"].find(f"{SVG}title")) == expected
    assert text_of(cells["2:3"].find(f"{SVG}title")) == "2:3 · failed"
    assert text_of(cells["2:2"].find(f"{SVG}title")) == "2:2 · unused · slow ×0.6"


def test_hue_is_replica_lightness_is_stage(plan):
    cells = _cells(parse_svg(cluster_map_svg(plan, None)))

    def hsl(device):
        hue, _, lightness = re.match(r"hsl\((\d+),(\d+)%,(\d+)%\)", cells[device].get("fill")).groups()
        return int(hue), int(lightness)

    assert hsl("0:0")[0] == hsl("1:3")[0] != hsl("2:0")[0]  # replica 0 vs replica 1
    assert hsl("0:0") == hsl("0:1")  # one stage, one colour
    assert hsl("0:0")[1] < hsl("0:2")[1] < hsl("1:0")[1] < hsl("1:2")[1]  # later stages lighter


def test_whole_node_exclusion_is_expanded():
    plan = small_plan(with_schedule=False)
    body = plan.model_dump()
    body["excluded_devices"] = ["2:*"]
    body["unused_devices"] = []
    body["replicas"][1]["stages"] = []
    root = parse_svg(cluster_map_svg(type(plan).model_validate(body), None))
    assert _marked(root, "failed") == {"2:0", "2:1", "2:2", "2:3"}


def test_2048_nodes_render_with_small_cells():
    plan = huge_cluster_plan(num_nodes=2048, gpus_per_node=8)
    text = cluster_map_svg(plan, None)
    root = parse_svg(text)
    assert len(find_class(root, "g", "node")) == 2048
    cells = _cells(root)
    assert len(cells) == 2048 * 8
    assert _marked(root, "failed") == {f"2047:{g}" for g in range(8)}
    assert len(_marked(root, "unused")) == len(plan.unused_devices)
    assert len(text.encode()) < 4_000_000, len(text.encode())
    assert float(root.get("width")) <= 1300 and float(root.get("height")) < 1500


def _hatches(root):
    return find_class(root, "path", "hatch")


def test_slow_hatching_covers_a_corner_so_used_and_unused_stay_apparent(plan):
    """0:3 is slow and used, 2:2 slow and unused: each keeps its own fill under a hatched corner."""
    root = parse_svg(cluster_map_svg(plan, SLOW_SPEEDS))
    cells = _cells(root)
    assert cells["0:3"].get("fill") == replica_color(0, 1, 4)  # replica 0, stage 1 of 4
    assert cells["2:2"].get("fill") == UNUSED_COLOR
    assert len(_hatches(root)) == len(SLOW_SPEEDS)
    cell_px = float(cells["0:3"].get("width"))
    for hatch in _hatches(root):
        # "M{x} 0h{leg}L{x} {leg}z": a right triangle on the top-left corner, legs shorter than the cell.
        leg_px = float(re.match(r"M[\d.]+ 0h([\d.]+)L", hatch.get("d")).group(1))
        assert 0 < leg_px < cell_px


def test_large_cells_say_replica_and_stage(plan):
    root = parse_svg(cluster_map_svg(plan, SLOW_SPEEDS))
    node0 = find_class(root, "g", "node")[0]
    texts = [text_of(t) for t in find_class(node0, "text", "cell-text")]
    assert texts == ["r0·s0", "r0·s0", "r0·s1", "r0·s1", "×0.5"]  # 0:3 is slow: its speed below its name


def test_a_small_cluster_gets_large_cells():
    layout = layout_for(2, 8)
    assert layout.cell_px == MAX_CELL_PX and layout.columns == 1
    assert layout.size_px[0] <= TARGET_WIDTH_PX


def test_a_mid_size_cluster_wraps_into_columns_for_larger_cells():
    """16 nodes in one column would need 24 px cells to stay under the height target; two columns fit 44 px."""
    layout = layout_for(16, 8)
    assert layout.columns == 2 and layout.cell_px == MAX_CELL_PX
    assert layout.size_px[0] <= TARGET_WIDTH_PX


def test_a_huge_cluster_uses_the_width_not_a_tall_strip():
    layout = layout_for(2048, 8)
    width_px, height_px = layout.size_px
    assert width_px <= TARGET_WIDTH_PX
    assert layout.columns >= 10 and height_px < 1000


def test_legend_names_every_replica_past_eight():
    plan = huge_cluster_plan(num_nodes=256)
    legend = map_legend(plan, None)
    assert [replica_id for replica_id, _ in legend.replicas] == [r.id for r in plan.replicas]
    assert len(legend.replicas) == 31
    assert len({color for _, color in legend.replicas}) == 31  # golden-angle hues do not repeat
    assert legend.headline.startswith("256 nodes × 8 GPUs")


@pytest.mark.parametrize("device", ["<b>", "0:1:2", "١:٢", "99999999:0", "0:999", "0 :1", "-1:0"])
def test_device_ids_the_map_cannot_place_are_a_clear_error(plan, device):
    body = plan.model_dump()
    body["unused_devices"] = [device]
    with pytest.raises(ClusterMapError, match="device id"):
        cluster_map_svg(type(plan).model_validate(body), None)
