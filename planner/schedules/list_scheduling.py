"""Greedy list schedules, the optimizer's warm starts, and orders in either backward form.

Warm start: the solver starts from the best of the caller's hint and a few
greedy list schedules (start whatever op can start earliest, ties by a
kind priority, optionally with an in-flight limit). With a slow stage and
enough microbatches these often meet the lower bound already; then they
are optimal and the solver is not run. Otherwise they are CP-SAT's hint
and cap its horizon.

`with_backward` turns an order's backwards into full ones (B) or split
ones (I then W), so a hint of either form can start either model.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from planner.schedules.ops import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Op,
    PipelineSpec,
    Schedule,
    op_kinds,
)

# --------------------------------------------------------------------------- schedules in either backward form


def with_backward(schedule: Schedule, split_backward: bool) -> Schedule:
    """The same order with full backwards (I -> B, W dropped) or split ones (B -> I then W).

    Both keep every dependency the simulator checks: a B waits for what
    its I waited for, and nothing waits for a W.
    """
    orders = []
    for order in schedule.orders:
        out: list[Op] = []
        for op in order:
            if split_backward and op.kind == BACKWARD:
                out += [Op(INPUT_GRAD, op.microbatch, op.chunk), Op(WEIGHT_GRAD, op.microbatch, op.chunk)]
            elif not split_backward and op.kind == INPUT_GRAD:
                out.append(Op(BACKWARD, op.microbatch, op.chunk))
            elif not split_backward and op.kind == WEIGHT_GRAD:
                continue
            else:
                out.append(op)
        orders.append(tuple(out))
    return Schedule(schedule.name, tuple(orders))


# --------------------------------------------------------------------------- warm starts


@dataclass(frozen=True)
class Start:
    """A starting point: an order, its simulated makespan and the sum over stages of its peak in-flight count."""

    schedule: Schedule
    makespan_ms: float
    peak_sum: int


def list_schedule(
    spec: PipelineSpec, split: bool, priority: tuple[str, ...], limit: list[int] | None, name: str = ""
) -> Start | None:
    """Greedy non-delay list schedule: again and again, start the op that can start earliest anywhere.

    Same-kind ops of a stage and chunk go in microbatch order, as in the
    CP-SAT model (`optimal`). Ties go to the kind listed first in
    `priority`. A forward starts only while its stage stays within the
    activation cap and holds fewer than `limit[s]` microbatch-chunks.
    Every op starts when its stage is free and its inputs exist, exactly
    as the simulator would run the resulting order, so the makespan is the
    simulated one. None if nothing can start (e.g. interleaved chunks that
    filled the memory).
    """
    p, v, m = spec.num_stages, spec.virtual_stages, spec.num_microbatches
    V, L = p * v, spec.hop_latency_ms
    back = INPUT_GRAD if split else BACKWARD
    release = WEIGHT_GRAD if split else BACKWARD
    kinds = op_kinds(split)
    # Kinds, microbatches and virtual stages as list indices, not dict keys: this loop runs a
    # few times per op, and hashing tuples was most of its time.
    index = {kind: k for k, kind in enumerate(kinds)}
    forward, backward_index = index[FORWARD], index[back]
    weight, input_grad = index.get(WEIGHT_GRAD), index.get(INPUT_GRAD)
    rank = [priority.index(kind) for kind in kinds]
    durations = [[[chunk.duration_ms(kind) for kind in kinds] for chunk in spec.chunks[s]] for s in range(p)]
    memory = [spec.memory_units(s) for s in range(p)]
    free = [0.0] * p
    held = [0] * p  # memory units
    alive = [0] * p  # microbatch-chunks
    peak = [0] * p
    following = [[[0] * v for _ in range(p)] for _ in kinds]  # next microbatch per kind, stage, chunk
    end: list[list[list[float | None]]] = [[[None] * V for _ in range(m)] for _ in kinds]
    orders: list[list[Op]] = [[] for _ in range(p)]

    def ready(k: int, mb: int, vs: int) -> float | None:
        if k == forward:
            return 0.0 if vs == 0 else (None if (t := end[forward][mb][vs - 1]) is None else t + L)
        if k == weight:
            return end[input_grad][mb][vs]
        own = end[forward][mb][vs]
        if own is None or vs == V - 1:
            return own
        later = end[backward_index][mb][vs + 1]
        return None if later is None else max(own, later + L)

    def candidate(s: int) -> tuple | None:
        best = None
        stage_memory, stage_free = memory[s], free[s]
        forward_allowed = limit is None or alive[s] < limit[s]
        for c in range(v):
            for k, kind in enumerate(kinds):
                mb = following[k][s][c]
                if mb >= m:
                    continue
                if k == forward and (
                    not forward_allowed
                    or (stage_memory is not None and held[s] + stage_memory[0][c] > stage_memory[1])
                ):
                    continue
                at = ready(k, mb, c * p + s)
                if at is not None:
                    key = (max(stage_free, at), rank[k], mb, s, c, kind)
                    if best is None or key < best:
                        best = key
        return best

    version = [0] * p
    heap: list[tuple] = []

    def refresh(s: int) -> None:
        version[s] += 1
        key = candidate(s)
        if key is not None:
            heapq.heappush(heap, (*key, version[s]))

    for s in range(p):
        refresh(s)
    while heap:
        at, _, mb, s, c, kind, seen = heapq.heappop(heap)
        if seen != version[s]:
            continue
        vs = c * p + s
        k = index[kind]
        finish = at + durations[s][c][k]
        end[k][mb][vs] = free[s] = finish
        following[k][s][c] += 1
        orders[s].append(Op(kind, mb, c))
        if kind == FORWARD:
            held[s] += memory[s][0][c] if memory[s] is not None else 0
            alive[s] += 1
        if kind == release:
            held[s] -= memory[s][0][c] if memory[s] is not None else 0
            alive[s] -= 1
        refresh(s)
        # Only the stage that waits for this op's result can start something new: a forward's
        # output feeds the next virtual stage, a backward's gradient the previous one, a W nothing.
        if kind == FORWARD and vs < V - 1 and (vs + 1) % p != s:
            refresh((vs + 1) % p)
        elif kind == back and vs > 0 and (vs - 1) % p != s:
            refresh((vs - 1) % p)
        peak[s] = max(peak[s], alive[s])
    if sum(map(len, orders)) < p * v * m * len(kinds):
        return None
    schedule = Schedule(f"list {'>'.join(priority)}{name}", tuple(map(tuple, orders)))
    return Start(schedule, max(free), sum(peak))


def warm_starts(spec: PipelineSpec, split: bool, good_enough_ms: float = 0.0) -> list[Start]:
    """List schedules: backward or forward first, in-flight limit none, v(p - s) or 2v(p - s);
    the rest are skipped once one fits memory within `good_enough_ms` (the caller would not
    improve on it).

    (W first, or W ahead of F, never won on the benchmark grid and is left out.)
    """
    p, v = spec.num_stages, spec.virtual_stages
    if split:
        priorities = [(INPUT_GRAD, FORWARD, WEIGHT_GRAD), (FORWARD, INPUT_GRAD, WEIGHT_GRAD)]
    else:
        priorities = [(BACKWARD, FORWARD), (FORWARD, BACKWARD)]
    limits = [(None, ""), ([v * (p - s) for s in range(p)], ", v(p-s) in flight"),
              ([2 * v * (p - s) for s in range(p)], ", 2v(p-s) in flight")]
    out = []
    for priority in priorities:
        for limit, name in limits:
            start = list_schedule(spec, split, priority, limit, name)
            if start is None:
                continue
            out.append(start)
            if start.makespan_ms <= good_enough_ms:
                return out
    return out


__all__ = ["Start", "list_schedule", "warm_starts", "with_backward"]
