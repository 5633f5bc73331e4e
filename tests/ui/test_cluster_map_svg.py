"""The cluster map: one cell per GPU, failed/slow/unused marks on exactly the right GPUs."""

from __future__ import annotations

import re

import pytest

from adapters.cluster_map_svg import cluster_map_svg, cluster_shape
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
    expected = "0:3 · replica 0 · stage 1 · layers [8, 16) · TP 2 · slow ×0.5"
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
