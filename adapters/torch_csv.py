"""A replica's pipeline schedule as the per-rank action CSV of `torch.distributed.pipelining`.

Format (PyTorch's "compute_only" schedule CSV, read by
`torch.distributed.pipelining.schedules._PipelineScheduleRuntime._load_csv`):
one row per pipeline rank, row r for PP-group rank r, which is physical
stage r of the exported replica (the devices of `plan.replicas[i].stages[r]`).
The row's cells are that rank's compute actions in the order it runs them,
each `{stage}{kind}{microbatch}`:

    F  forward                         `F3`   -> `0F3`
    B  full backward                   `B3`   -> `0B3`
    I  backward for the input grads    `I3`   -> `0I3`   (zero-bubble B half)
    W  backward for the weight grads   `W3`   -> `0W3`   (the deferred half)

where `stage` is PyTorch's stage index: the virtual stage `chunk * p + r`
of a replica with p physical stages, so `F3.1` on rank 1 of a 4-stage
pipeline is `5F3`. That is PyTorch's (and torchtitan's) "loop" placement,
the one `PipelineStage`s built by `stage_index = rank + chunk * p` have;
`_load_csv` infers the stage-to-rank mapping from which row a stage
appears in. Rows differ in length; there is no header.

Loading it (PyTorch 2.13; the API is private and may move):

    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    stages = [PipelineStage(chunk_module[c], rank + c * p, p * v, device, group=pp_group)
              for c in range(v)]
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=loss_fn)
    schedule._load_csv("replica0.csv")    # validates, then adds the send/recv ops
    schedule.step(x) / step(target=y, losses=losses) / step()   # first / last / other ranks

with m the replica's `num_microbatches` and v the plan's `virtual_stages`.
`_load_csv` rejects a schedule that misses or repeats work (every stage
must run F for all m microbatches, and B, or I then W, for each) or whose
order cannot be lowered to sends and receives without deadlock. torchtitan
takes the same file with `--parallelism.pipeline_parallel_schedule_csv
PATH`, which makes it build a `_PipelineScheduleRuntime` with the local
stages and call `_load_csv`; its other pipeline settings (degree, layers
per stage, microbatch size) must give the same p, v and m as the plan.

PyTorch runs the file's order as written, with three differences from the
plan's simulated timeline. It adds a REDUCE_GRAD (gradient scaling, DP
reduction) after each stage's last B or W, and unshard/reshard around a
stage's compute when it is FSDP-wrapped; the timeline leaves both to the
plan's data-parallel estimate. And on virtual stage 0, whose input needs
no gradient, its I does nothing and its W runs the whole backward (the
same total work, finished later on that one stage).

One file is one pipeline: PyTorch's runtime needs every rank of one
pipeline-parallel group, and nothing about data-parallel peers. A
non-uniform plan has replicas with different stage counts or layer splits;
export each replica (`replica_id`) and hand each PP group its own file.
Replicas listed together in one `replica_ids` share a schedule, hence a
file. Without a replica id the slowest replica's schedule is exported.
"""

from __future__ import annotations

import csv
import io

from adapters.registry import ExportError, replica_schedule
from planner.schedules.ops import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Op,
    ScheduleError,
    parse_op,
)
from wire.schemas import Plan


def render(plan: Plan, replica_id: int | None) -> str:
    """The CSV of `replica_id`'s schedule (the slowest replica's when None).

    ExportError when the plan has no schedule or no such replica, or when a
    stage's ops are not what PyTorch accepts (see `_check_complete`).
    """
    entry = replica_schedule(plan, replica_id)
    name = f"replica {entry.replica_ids[0]}" if len(entry.replica_ids) == 1 else f"replicas {entry.replica_ids}"
    timelines = sorted(entry.stages, key=lambda timeline: timeline.stage)
    p = len(timelines)
    if [timeline.stage for timeline in timelines] != list(range(p)):
        raise ExportError(f"{name}: stages {[t.stage for t in timelines]} are not 0..{p - 1}")
    orders = [_ops(timeline.ops, f"{name}, stage {timeline.stage}") for timeline in timelines]
    _check_complete(name, orders, _num_microbatches(plan, entry.replica_ids, orders))
    rows = [[_action(op, stage, p) for op in order] for stage, order in enumerate(orders)]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


def action(label: str, stage: int, num_stages: int) -> str:
    """PyTorch's action string for one of our op labels on physical stage `stage` of `num_stages`."""
    return _action(_ops([label], f"stage {stage}")[0], stage, num_stages)


def _action(op: Op, stage: int, num_stages: int) -> str:
    return f"{op.chunk * num_stages + stage}{op.kind}{op.microbatch}"


def _ops(labels: list[str], where: str) -> list[Op]:
    try:
        return [parse_op(label) for label in labels]
    except ScheduleError as exc:
        raise ExportError(f"{where}: {exc}") from None


def _num_microbatches(plan: Plan, replica_ids: list[int], orders: list[list[Op]]) -> int:
    """The replica's num_microbatches: the n_microbatches a trainer passes to PyTorch with this file."""
    counts = {replica.num_microbatches for replica in plan.replicas if replica.id in replica_ids}
    if len(counts) == 1:
        return counts.pop()
    return sum(1 for op in orders[0] if op.kind == FORWARD and op.chunk == 0) if orders else 0


def _check_complete(name: str, orders: list[list[Op]], m: int) -> None:
    """What PyTorch's `_validate_schedule` demands, said in our terms before a trainer finds out.

    Every chunk of every stage runs F once for each of the replica's m
    microbatches, and B, or I and later W, once for each. (Whether the
    order can run without deadlock PyTorch checks when it adds the
    sends and receives; the planner's simulator has checked it already.)
    """
    if m < 1 or not orders:
        raise ExportError(f"{name}: no microbatches or no stages, nothing to export")
    v = max(op.chunk for order in orders for op in order) + 1 if any(orders) else 1
    expected = list(range(m))
    for stage, order in enumerate(orders):
        for chunk in range(v):
            got = {kind: sorted(op.microbatch for op in order if op.chunk == chunk and op.kind == kind)
                   for kind in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)}
            if got[FORWARD] != expected or sorted(got[BACKWARD] + got[INPUT_GRAD]) != expected \
                    or got[INPUT_GRAD] != got[WEIGHT_GRAD]:
                where = f"{name}, stage {stage}" + (f", chunk {chunk}" if v > 1 else "")
                raise ExportError(
                    f"{where}: PyTorch needs F, and B or I and W, once for each of microbatches 0..{m - 1}; "
                    f"got F {got[FORWARD]}, B {got[BACKWARD]}, I {got[INPUT_GRAD]}, W {got[WEIGHT_GRAD]}"
                )
        input_grads_done: set[Op] = set()
        for op in order:
            if op.kind == INPUT_GRAD:
                input_grads_done.add(op)
            elif op.kind == WEIGHT_GRAD and Op(INPUT_GRAD, op.microbatch, op.chunk) not in input_grads_done:
                raise ExportError(f"{name}, stage {stage}: {op.label()} runs before {op.label().replace('W', 'I', 1)}")
