"""The data-parallel gradient sync a schedule leaves exposed, read from its timeline.

A plan's iteration is its makespan plus the exposed gradient sync plus the optimizer step. Before its
schedule is known, the sync is priced as Megatron overlaps it under 1F1B (`GradSync.exposed_ms`,
`cost_models.iteration.exposed_dp_sync_ms`): buckets all-reduce under the last microbatch's backward,
at least the last bucket exposed, and ZeRO-1's weight all-gather runs under the next iteration's first
forward (`GradSync.gather_exposed_ms`, the same whatever the schedule). That holds for every schedule
here but one.

Breadth-first pipelining (Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2022; PyTorch's
ScheduleLoopedBFS) finishes a stage's model chunks one after another, the last first: chunk c's
gradients are final when its last backward ends, and data-parallel reduce hooks (PyTorch DDP buckets,
FSDP's per-module reduce-scatter) start as soon as they are. So per stage, each chunk's share of the
sync (1/v: a chunk holds 1/v of the stage's layers) goes over the link after the previous share,
starting when its chunk's last backward starts (its buckets fill during it, as in the 1F1B model) and
ending no earlier than one last bucket after that backward ends. The iteration waits for the stage
whose sync ends last; `sync_shift_ms` is how much that moves the plan's number against the 1F1B
price. Interleaved 1F1B is left at the 1F1B price (Megatron overlaps finished chunks' sync there
too; issue 17 extends the model to it).
"""

from __future__ import annotations

from cost_models.choices import ScheduleName
from planner.schedules.ops import BACKWARD, WEIGHT_GRAD, PipelineSpec, TimedOp


def _last_backward_per_chunk(timeline: tuple[TimedOp, ...], chunks: int) -> list[TimedOp]:
    """Each chunk's last backward op (B, or W when split), in chunk order."""
    last: dict[int, TimedOp] = {}
    for timed in timeline:
        if timed.op.kind in (BACKWARD, WEIGHT_GRAD) and (
            timed.op.chunk not in last or timed.end_ms > last[timed.op.chunk].end_ms
        ):
            last[timed.op.chunk] = timed
    return [last[c] for c in range(chunks)]


def chunked_sync_end_ms(timeline: tuple[TimedOp, ...], chunks: int, full_ms: float, last_bucket_ms: float) -> float:
    """When a stage's sync ends if each chunk's share starts as its last backward starts, in the order
    the chunks finish, one share at a time on the link."""
    share_ms = full_ms / chunks
    link_free_ms = float("-inf")
    for timed in sorted(_last_backward_per_chunk(timeline, chunks), key=lambda t: t.end_ms):
        start_ms = max(link_free_ms, timed.start_ms)
        link_free_ms = max(start_ms + share_ms, timed.end_ms + last_bucket_ms)
    return link_free_ms


def sync_shift_ms(schedule_name: str, spec: PipelineSpec, timelines: tuple[tuple[TimedOp, ...], ...],
                  makespan_ms: float) -> float:
    """What the schedule's exposed sync differs by from the 1F1B price; 0 for schedules priced at it, or
    when the spec carries no sync. Never positive: ZeRO-1's weight all-gather is priced alike in both,
    chunk 0's share alone overlaps its last backward as the 1F1B model's whole reduction does, and each
    earlier share has its chunk's m backwards after it, at least one stage backward, so the chunked end is
    at most the 1F1B one (the cap guards rounding and stages slower than the full-speed peers the 1F1B
    price assumes)."""
    if schedule_name != ScheduleName.LOOPED_BFS or spec.grad_sync is None:
        return 0.0
    priced_ms = max(sync.exposed_ms for sync in spec.grad_sync)
    # Each stage's weight all-gather (ZeRO-1) adds to what its reduction leaves past the makespan.
    exposed = [max(0.0, chunked_sync_end_ms(timeline, spec.virtual_stages, sync.full_ms, sync.last_bucket_ms)
                   - makespan_ms) + sync.gather_exposed_ms
               for timeline, sync in zip(timelines, spec.grad_sync)]
    return min(0.0, max(exposed) - priced_ms)
