"""The schedule Gantt chart: well-formed, one row per stage, one rect per op where the timeline puts it."""

from __future__ import annotations

import pytest

from adapters.registry import ExportError, export_format
from render.gantt_svg import (
    LEGEND_WRAP_PX,
    MARGIN_PX,
    MAX_STYLED_CHUNKS,
    device_range,
    nice_step_ms,
    render,
)
from tests.ui.plans import interleaved_plan, large_plan, small_plan
from tests.ui.svg_support import SVG, classes, find_class, parse_svg, text_of

TOLERANCE_PX = 0.02  # coordinates are written to 0.01 px


@pytest.fixture(scope="module")
def plan():
    return small_plan()


def _rows(root):
    return find_class(root, "g", "row")


def _ops(row):
    group = find_class(row, "g", "ops")[0]
    return group.findall(f"{SVG}rect")


def _axis(row):
    """(left px, px per ms) from the row's idle background, which spans [0, makespan]."""
    idle = find_class(row, "rect", "idle")[0]
    return float(idle.get("x")), float(idle.get("width"))


@pytest.mark.parametrize("replica_id", [0, 1])
def test_one_row_per_stage_one_rect_per_op_at_its_times(plan, replica_id):
    entry = next(e for e in plan.pipeline_schedule.replicas if replica_id in e.replica_ids)
    root = parse_svg(render(plan, replica_id))
    rows = _rows(root)
    assert [int(r.get("data-stage")) for r in rows] == [t.stage for t in entry.stages]
    for row, timeline in zip(rows, entry.stages):
        left_px, plot_px = _axis(row)
        px_per_ms = plot_px / entry.makespan_ms
        rects = _ops(row)
        assert len(rects) == len(timeline.ops)
        for rect, op, start_ms, end_ms in zip(rects, timeline.ops, timeline.start_ms, timeline.end_ms):
            assert op[0] in classes(rect), (op, rect.get("class"))
            assert float(rect.get("x")) == pytest.approx(left_px + start_ms * px_per_ms, abs=TOLERANCE_PX)
            assert float(rect.get("width")) == pytest.approx((end_ms - start_ms) * px_per_ms, abs=TOLERANCE_PX)


def test_gaps_between_ops_are_idle_background(plan):
    """Idle time is where no op rect covers the row's background: stage 3 of 1F1B waits before its first F."""
    entry = next(e for e in plan.pipeline_schedule.replicas if 0 in e.replica_ids)
    row = _rows(parse_svg(render(plan, 0)))[3]
    left_px, _ = _axis(row)
    first = _ops(row)[0]
    assert entry.stages[3].start_ms[0] > 0
    assert float(first.get("x")) > left_px + 1


def test_slow_label_exactly_on_slow_stages(plan):
    for replica in plan.replicas:
        rows = _rows(parse_svg(render(plan, replica.id)))
        for row, stage in zip(rows, replica.stages):
            slow_labels = [text_of(t) for t in row.iter(f"{SVG}tspan") if "slow" in classes(t)]
            if stage.speed < 1:
                assert slow_labels == [f"slow ×{stage.speed:g}"]
                assert "slow-stage" in classes(row)
            else:
                assert slow_labels == []
                assert "slow-stage" not in classes(row)


def test_row_labels_name_stage_tp_devices_and_layers(plan):
    rows = _rows(parse_svg(render(plan, 0)))
    label = text_of(find_class(rows[1], "text", "lbl")[0])
    for part in ("stage 1", "TP 2", "layers [8, 16)", "0:2-3", "slow ×0.5"):
        assert part in label


def test_legend_lists_the_kinds_present_and_idle(plan):
    one_f_one_b = text_of(find_class(parse_svg(render(plan, 0)), "g", "legend")[0])
    assert "F forward" in one_f_one_b and "B backward" in one_f_one_b and "idle" in one_f_one_b
    assert "slow stage" in one_f_one_b
    zero_bubble = text_of(find_class(parse_svg(render(plan, 1)), "g", "legend")[0])
    assert "I input grad" in zero_bubble and "W weight grad" in zero_bubble
    assert "B backward" not in zero_bubble


def test_title_names_schedule_makespan_and_bubble(plan):
    entry = next(e for e in plan.pipeline_schedule.replicas if 0 in e.replica_ids)
    title = text_of(find_class(parse_svg(render(plan, 0)), "text", "title")[0])
    assert entry.schedule in title
    assert f"{entry.makespan_ms:,.1f}" in title or f"{entry.makespan_ms:,.3f}".rstrip("0").rstrip(".") in title
    assert f"bubble {entry.bubble_fraction * 100:.1f} %" in title


def test_text_is_escaped(plan):
    """The model name holds <, & and quotes: the document still parses and shows them verbatim."""
    root = parse_svg(render(plan, 0))
    assert any(plan.model in text_of(t) for t in root.iter(f"{SVG}text"))


def test_default_is_the_slowest_replica(plan):
    slowest = max(plan.pipeline_schedule.replicas, key=lambda e: e.makespan_ms)
    assert render(plan, None) == render(plan, slowest.replica_ids[0])


def test_unknown_replica_and_missing_schedule_are_export_errors(plan):
    with pytest.raises(ExportError, match="no replica 7"):
        render(plan, 7)
    with pytest.raises(ExportError, match="no pipeline_schedule"):
        render(small_plan(with_schedule=False), None)


def test_registry_serves_it():
    exporter = export_format("svg")
    assert exporter.media_type == "image/svg+xml"
    parse_svg(exporter.render(small_plan(), None))


def test_interleaved_chunks_are_marked():
    plan = interleaved_plan()
    root = parse_svg(render(plan, None))
    rects = _ops(_rows(root)[0])
    ops = plan.pipeline_schedule.replicas[0].stages[0].ops
    for rect, op in zip(rects, ops):
        assert ("c1" in classes(rect)) == op.endswith(".1"), op
    assert "later model chunk" in text_of(find_class(root, "g", "legend")[0])


def test_wide_ops_get_labels_and_titles(plan):
    row = _rows(parse_svg(render(plan, 0)))[0]
    labels = [text_of(t) for t in find_class(row, "text", "op")]
    assert "F0" in labels and "B7" in labels
    assert all(rect.find(f"{SVG}title") is not None for rect in _ops(row))


def test_64_stages_512_microbatches_stay_small():
    plan = large_plan(num_stages=64, microbatches=512)
    text = render(plan, None)
    root = parse_svg(text)
    rows = _rows(root)
    assert len(rows) == 64
    assert sum(len(_ops(row)) for row in rows) == 64 * 512 * 2  # nothing merged
    assert find_class(root, "text", "op") == []  # ~0.3 px wide ops: no labels
    assert not any(rect.find(f"{SVG}title") is not None for rect in _ops(rows[0]))
    assert len(text.encode()) < 6_000_000, len(text.encode())  # ~70 bytes per op
    slow_rows = [row.get("data-stage") for row in rows if "slow-stage" in classes(row)]
    assert slow_rows == ["5"]


def test_device_range_compacts_runs():
    assert device_range(["3:0", "3:1", "3:2", "3:3"]) == "3:0-3"
    assert device_range(["3:6", "3:7", "4:0", "4:1"]) == "3:6-7,4:0-1"
    assert device_range(["0:0", "0:2"]) == "0:0+2"
    assert device_range(["5:1"]) == "5:1"


@pytest.mark.parametrize("span_ms,step_ms", [(654.3, 100.0), (480.0, 50.0), (31_513.0, 5000.0), (1.0, 0.1), (136.0, 20.0)])
def test_nice_step(span_ms, step_ms):
    assert nice_step_ms(span_ms) == pytest.approx(step_ms)


def test_every_op_rect_names_its_op(plan):
    """A viewer that zooms in labels ops from `data-op`: it must be every rect's own op."""
    entry = next(e for e in plan.pipeline_schedule.replicas if 1 in e.replica_ids)
    for row, timeline in zip(_rows(parse_svg(render(plan, 1))), entry.stages):
        assert [rect.get("data-op") for rect in _ops(row)] == timeline.ops


def test_op_labels_are_clipped_to_the_plot_in_their_own_group(plan):
    root = parse_svg(render(plan, 0))
    clip = root.find(f"{SVG}defs/{SVG}clipPath")
    assert clip is not None and clip.get("id") == "gantt-plot"
    for row in _rows(root):
        plot = find_class(row, "g", "plot")[0]
        assert plot.get("clip-path") == "url(#gantt-plot)"
        labels = find_class(plot, "g", "op-labels")[0]
        assert all(classes(text) & {"op"} for text in labels)
        assert find_class(plot, "g", "ops")[0].findall(f"{SVG}text") == []


def test_row_label_hover_names_memory_microbatches_and_times(plan):
    row = _rows(parse_svg(render(plan, 0)))[1]
    title = text_of(find_class(row, "text", "lbl")[0].find(f"{SVG}title"))
    for part in ("stage 1", "TP 2", "devices 0:2, 0:3", "8 microbatches", "memory 40.0 / 80 GiB",
                 "forward 20 ms, backward 40 ms per microbatch", "speed ×0.5"):
        assert part in title, part
    subtitle = text_of(find_class(parse_svg(render(plan, 0)), "text", "subtitle")[0])
    assert "8 microbatches" in subtitle


def test_root_carries_the_geometry_a_zooming_viewer_needs(plan):
    entry = next(e for e in plan.pipeline_schedule.replicas if 0 in e.replica_ids)
    root = parse_svg(render(plan, 0))
    left_px, width_px = _axis(_rows(root)[0])
    assert float(root.get("data-plot-left-px")) == pytest.approx(left_px)
    assert float(root.get("data-plot-width-px")) == pytest.approx(width_px)
    assert float(root.get("data-makespan-ms")) == entry.makespan_ms


def test_ops_the_grammar_does_not_know_get_a_neutral_class():
    plan = small_plan()
    body = plan.model_dump()
    ops = body["pipeline_schedule"]["replicas"][0]["stages"][0]["ops"]
    ops[0], ops[1], ops[2] = 'Z1" onload="x', "F1.99999999", "F2.x"
    root = parse_svg(render(type(plan).model_validate(body), 0))
    rects = _ops(_rows(root)[0])
    assert classes(rects[0]) == {"X"} and rects[0].get("data-op") == 'Z1" onload="x'
    assert classes(rects[1]) == {"F", f"c{MAX_STYLED_CHUNKS - 1}"}  # capped: the style sheet stays bounded
    assert classes(rects[2]) == {"F"}
    assert all(not name.startswith("on") for element in root.iter() for name in element.attrib)
    assert "unknown op" in text_of(find_class(root, "g", "legend")[0])


def test_legend_wraps_instead_of_running_off_a_narrow_window():
    """Five items (F, B, later chunk, idle, slow stage) are wider than one legend line: two lines, rows below."""
    body = interleaved_plan().model_dump()
    body["replicas"][0]["stages"][0]["speed"] = 0.5
    root = parse_svg(render(type(interleaved_plan()).model_validate(body), None))
    swatches = find_class(root, "g", "legend")[0].findall(f"{SVG}rect")
    assert len(swatches) == 5
    assert len({s.get("y") for s in swatches}) == 2
    assert all(float(s.get("x")) < MARGIN_PX + LEGEND_WRAP_PX for s in swatches)
    first_row_top = float(_rows(root)[0].get("transform").split(",")[1].rstrip(")"))
    assert first_row_top > max(float(s.get("y")) for s in swatches) + 12  # rows start below the legend
