"""The torch-csv export: our op labels as PyTorch pipelining actions, accepted and executed by PyTorch itself."""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from torch.distributed.pipelining.schedules import _Action

from adapters.registry import ExportError, export_format
from adapters.torch_csv import action, render
from cli import main as cli_main
from planner.schedules.handcrafted import (
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    zb_h1,
    zb_h2,
)
from planner.schedules.ops import Schedule
from tests.adapters.support import (
    run_child,
    run_worker,
    schedule_plan,
    torch_load,
    uniform_spec,
)


def _rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


def _plan(schedule: Schedule, p: int, m: int, v: int = 1, replica_ids: tuple[int, ...] = (0,)):
    return schedule_plan((replica_ids, schedule, uniform_spec(p, m, v)))


# ---------------------------------------------------------------------------------------------------------------
# Unit: labels to actions


@pytest.mark.parametrize(
    ("label", "stage", "num_stages", "expected"),
    [
        ("F3", 0, 4, "0F3"),
        ("B0", 3, 4, "3B0"),
        ("I12", 2, 4, "2I12"),
        ("W12", 2, 4, "2W12"),
        ("F3.1", 1, 4, "5F3"),  # chunk 1 of physical stage 1 is virtual stage 1 * 4 + 1
        ("B7.2", 0, 3, "6B7"),
        ("W0.1", 2, 3, "5W0"),
    ],
)
def test_label_to_action(label, stage, num_stages, expected):
    assert action(label, stage, num_stages) == expected
    parsed = _Action.from_str(expected)
    assert str(parsed) == expected  # PyTorch round-trips it unchanged
    assert parsed.computation_type.value == label[0]


def test_one_row_per_rank_in_order():
    rows = _rows(render(_plan(one_f_one_b(2, 4), 2, 4), None))
    assert rows == [
        ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
        ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"],
    ]


def test_interleaved_uses_looped_virtual_stages():
    p, m, v = 2, 4, 2
    plan = _plan(interleaved_1f1b(p, m, v), p, m, v)
    rows = _rows(render(plan, None))
    for rank, (row, timeline) in enumerate(zip(rows, plan.pipeline_schedule.replicas[0].stages)):
        assert len(row) == len(timeline.ops)
        stage_indices = {_Action.from_str(cell).stage_index for cell in row}
        assert stage_indices == {rank, rank + p}  # chunk c of rank r is virtual stage c * p + r
        for label, cell in zip(timeline.ops, row):
            chunk = int(label.partition(".")[2] or 0)
            assert cell == f"{chunk * p + rank}{label[0]}{label[1:].partition('.')[0]}"


@pytest.mark.parametrize("builder", [zb_h1, zb_h2])
def test_zero_bubble_keeps_input_and_weight_halves_apart(builder):
    p, m = 3, 6
    plan = _plan(builder(p, m), p, m)
    rows = _rows(render(plan, None))
    for rank, (row, timeline) in enumerate(zip(rows, plan.pipeline_schedule.replicas[0].stages)):
        assert row == [f"{rank}{label}" for label in timeline.ops]  # same order, nothing merged into B
        kinds = [_Action.from_str(cell).computation_type.value for cell in row]
        assert kinds.count("I") == kinds.count("W") == m and "B" not in kinds


def test_deferred_weight_gradients_stay_deferred():
    rows = _rows(render(_plan(zb_h2(3, 6), 3, 6), None))
    assert rows[0].index("0W0") == rows[0].index("0I0") + 1  # stage 0 has no one upstream to wait for it
    assert rows[2].index("2W0") > rows[2].index("2I2")  # stage s lets each W trail its I by s backwards


def test_replica_choice_non_uniform_plan():
    plan = schedule_plan(
        ((0, 2), one_f_one_b(2, 4), uniform_spec(2, 4)),
        ((1,), one_f_one_b(3, 4), uniform_spec(3, 4)),  # the deeper pipeline is the slower one
    )
    assert len(_rows(render(plan, 0))) == 2
    assert len(_rows(render(plan, 2))) == 2
    assert len(_rows(render(plan, 1))) == 3
    assert render(plan, None) == render(plan, 1)


def test_unknown_replica_is_an_export_error():
    plan = _plan(one_f_one_b(2, 4), 2, 4, replica_ids=(0, 1))
    with pytest.raises(ExportError, match="no replica 5; its replicas are 0..1"):
        render(plan, 5)


def test_plan_without_schedule_is_an_export_error():
    plan = _plan(one_f_one_b(2, 4), 2, 4).model_copy(update={"pipeline_schedule": None})
    with pytest.raises(ExportError, match="no pipeline_schedule"):
        render(plan, None)


def test_incomplete_or_unparsable_stage_is_an_export_error():
    plan = _plan(one_f_one_b(2, 4), 2, 4)
    ops = plan.pipeline_schedule.replicas[0].stages[1].ops
    broken = plan.model_copy(deep=True)
    broken.pipeline_schedule.replicas[0].stages[1].ops = [op for op in ops if op != "B2"]
    with pytest.raises(ExportError, match=r"replica 0, stage 1: PyTorch needs F, and B or I and W, once for each of "
                                          r"microbatches 0\.\.3; got F \[0, 1, 2, 3\], B \[0, 1, 3\]"):
        render(broken, None)
    broken.pipeline_schedule.replicas[0].stages[1].ops = ["X1", *ops]
    with pytest.raises(ExportError, match="replica 0, stage 1: bad operation 'X1'"):
        render(broken, None)


def test_schedule_must_cover_the_replicas_microbatches():
    """A trainer passes the replica's num_microbatches to PyTorch; a schedule for fewer would be rejected there."""
    plan = _plan(interleaved_1f1b(2, 4, 2), 2, 4, 2)
    plan.replicas[0].num_microbatches = 6
    with pytest.raises(ExportError, match=r"replica 0, stage 0, chunk 0: .* microbatches 0\.\.5"):
        render(plan, 0)


def test_weight_half_before_its_input_half_is_an_export_error():
    plan = _plan(zb_h1(2, 2), 2, 2)
    broken = plan.model_copy(deep=True)
    last = broken.pipeline_schedule.replicas[0].stages[1]
    last.ops = ["F0", "W0", "I0", "F1", "I1", "W1"]
    with pytest.raises(ExportError, match="replica 0, stage 1: W0 runs before I0"):
        render(broken, None)


def test_registry_and_cli_serve_this_renderer(tmp_path):
    plan = _plan(zb_h1(2, 4), 2, 4)
    expected = render(plan, None)
    assert export_format("torch-csv").render(plan, 0) == expected
    plan_file, out = tmp_path / "plan.json", tmp_path / "plan.csv"
    plan_file.write_text(plan.model_dump_json())
    assert cli_main(["export", "--format", "torch-csv", str(plan_file), "-o", str(out)]) == 0
    assert out.read_text() == expected


# ---------------------------------------------------------------------------------------------------------------
# PyTorch's own validation: _PipelineScheduleRuntime._load_csv, then its comms simulator


SCHEDULES = {
    "gpipe": lambda p, m: (gpipe(p, m), 1),
    "1f1b": lambda p, m: (one_f_one_b(p, m), 1),
    "interleaved-v2": lambda p, m: (interleaved_1f1b(p, m, 2), 2),
    "interleaved-v3": lambda p, m: (interleaved_1f1b(p, m, 3), 3),
    "zb-h1": lambda p, m: (zb_h1(p, m), 1),
    "zb-h2": lambda p, m: (zb_h2(p, m), 1),
    "looped-bfs-v2": lambda p, m: (looped_bfs(p, m, 2), 2),
}


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 6), (3, 2)])  # (4, 6): uneven interleaving groups
def test_pytorch_accepts_export(name, p, m, tmp_path):
    schedule, v = SCHEDULES[name](p, m)
    text = render(_plan(schedule, p, m, v), None)
    loaded = torch_load(text, tmp_path, p, v, m)
    assert loaded.stage_index_to_group_rank == {c * p + r: r for c in range(v) for r in range(p)}
    assert {rank: [str(a) for a in actions] for rank, actions in loaded.pipeline_order.items()} == dict(
        enumerate(_rows(text))
    )


def test_pytorch_rejects_a_deadlocking_order(tmp_path):
    """Complete per stage (passes our check and PyTorch's counts) but stage 0 waits on B0 before sending F1."""
    plan = _plan(one_f_one_b(2, 4), 2, 4)
    broken = plan.model_copy(deep=True)
    broken.pipeline_schedule.replicas[0].stages[0].ops = ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    broken.pipeline_schedule.replicas[0].stages[1].ops = ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    text = render(broken, None)
    with pytest.raises(AssertionError, match="Malformed compute schedule"):
        torch_load(text, tmp_path, 2, 1, 4)


def test_pytorch_rejects_a_missing_action(tmp_path):
    text = render(_plan(one_f_one_b(2, 4), 2, 4), None).replace(",1B3", "")
    with pytest.raises(AssertionError, match="stage 1: expected 4 total backwards"):
        torch_load(text, tmp_path, 2, 1, 4)


def test_pytorch_rejects_weight_before_input(tmp_path):
    text = render(_plan(zb_h1(2, 2), 2, 2), None)
    rows = _rows(text)
    rows[1] = ["1F0", "1W0", "1I0", "1F1", "1I1", "1W1"]
    with pytest.raises(AssertionError, match="Backward Weight for stage 1, microbatch 0 without first running"):
        torch_load("\n".join(",".join(r) for r in rows) + "\n", tmp_path, 2, 1, 2)


# ---------------------------------------------------------------------------------------------------------------
# A real run on gloo: PyTorch executes the exported schedule and gets the single-process gradients


def _cases(tmp_path: Path, p: int, m: int, names: list[str]) -> list[tuple[str, str, int, int]]:
    cases = []
    for name in names:
        schedule, v = SCHEDULES[name](p, m)
        path = tmp_path / f"{name}-p{p}-m{m}.csv"
        path.write_text(render(_plan(schedule, p, m, v), None))
        cases.append((f"{name} p={p}", str(path), v, m))
    return cases


def _join(context, seconds: float) -> bool:
    """True once every child exited cleanly; raises the first child's error (with its traceback)."""
    deadline = time.monotonic() + seconds
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            return False
    return True


def test_gloo_ranks_train_like_one_process(tmp_path):
    """4 ranks run 1F1B, ZB-H1 and interleaved (v=2); then ranks 0-1 run every schedule as a 2-stage pipeline.

    This process is rank 0 and spawns ranks 1-3, so the test uses four processes.
    """
    world = 4
    runs = [
        (4, _cases(tmp_path, 4, 8, ["1f1b", "zb-h1", "interleaved-v2"])),
        (2, _cases(tmp_path, 2, 4, ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-v2", "looped-bfs-v2"])),
        (2, _cases(tmp_path, 2, 3, ["interleaved-v3"])),  # m not a multiple of p, 3 chunks per rank
    ]
    store = str(tmp_path / "store")
    children = mp.start_processes(
        run_child, args=(world, store, runs), nprocs=world - 1, join=False, start_method="spawn"
    )
    try:
        try:
            run_worker(0, world, store, runs)
        except BaseException:
            _join(children, seconds=10)  # a child's failure is usually the cause: raise that one if there is one
            raise
        assert _join(children, seconds=60), "ranks 1-3 did not finish within a minute"
    finally:
        for process in children.processes:
            if process.is_alive():
                process.terminate()
