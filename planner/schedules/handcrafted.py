"""Hand-written pipeline schedules: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, looped BFS.

Each builder returns only the per-stage ORDER of operations for a shape
(stages, microbatches, chunks); the simulator turns an order plus a spec's
operation times into a timeline. Building orders without times keeps the
schedules comparable under any stage speeds and lets one order be reused
for every candidate layout of the same shape.

The 1F1B family shares one shape per stage: w forwards, then in round k
the backward of microbatch k (B, or I and the W's that are due) and the
forward of microbatch k + w, until the forwards run out. Such an order
cannot deadlock when w >= 1 and w never grows along the pipeline: round
k's backwards need only the next stage's round-k backward and earlier
work, so they complete from the last stage up; the forward that follows
needs an upstream forward from round k or earlier, so those complete from
the first stage down.
"""

from __future__ import annotations

from cost_models.choices import ScheduleName
from cost_models.pipeline import interleaved_group_sizes
from planner.schedules.ops import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Op,
    PipelineSpec,
    Schedule,
    ScheduleError,
)


def _check_shape(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"a schedule needs at least 1 stage and 1 microbatch, got {stages} and {microbatches}")


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards in the same microbatch order (as PyTorch's ScheduleGPipe).

    Every stage holds all m microbatches' activations at its peak.
    """
    _check_shape(stages, microbatches)
    order = tuple(Op(FORWARD, k) for k in range(microbatches)) + tuple(Op(BACKWARD, k) for k in range(microbatches))
    return Schedule(ScheduleName.GPIPE, (order,) * stages)


def _one_f_one_b_order(microbatches: int, forwards_first: int, split: bool, weight_lag: int = 0) -> tuple[Op, ...]:
    """`forwards_first` forwards, then per microbatch k: its backward, then F(k + forwards_first).

    With `split` the backward is I(k), and W(j) runs once j <= k - weight_lag:
    each step of lag keeps one more microbatch alive (its activations stay
    until W ends) but lets the next I, which the upstream stage waits for,
    go first. The W's still owed close the order.
    """
    m, w = microbatches, forwards_first
    ops = [Op(FORWARD, k) for k in range(w)]
    next_weight = 0
    for k in range(m):
        if split:
            ops.append(Op(INPUT_GRAD, k))
            while next_weight <= k - weight_lag:
                ops.append(Op(WEIGHT_GRAD, next_weight))
                next_weight += 1
        else:
            ops.append(Op(BACKWARD, k))
        if k + w < m:
            ops.append(Op(FORWARD, k + w))
    if split:
        ops.extend(Op(WEIGHT_GRAD, j) for j in range(next_weight, m))
    return tuple(ops)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """PipeDream-flush / Megatron's non-interleaved schedule.

    Stage s warms up with min(p - s - 1, m) forwards, then alternates one
    forward and one backward, then drains the remaining backwards. It holds
    at most min(p - s, m) microbatches: the fewest that still keep every
    stage busy in the steady state on equal stages.
    """
    _check_shape(stages, microbatches)
    orders = tuple(_one_f_one_b_order(microbatches, min(stages - s, microbatches), split=False) for s in range(stages))
    return Schedule(ScheduleName.ONE_F_ONE_B, orders)


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., ICLR 2024) within 1F1B's memory as this project counts it.

    1F1B's order with each B split into I then W: the upstream stage gets
    its gradient when I ends, so the weight gradients leave the backward
    chain, and the W's run in the time 1F1B's stages spent waiting for that
    chain. Activations stay alive until W ends (the simulator's model), so
    stage s can keep 1F1B's p - s microbatches only if W(k) runs before the
    next forward: every W directly follows its I. That makes the order
    never slower than 1F1B for any stage times (every op's inputs are ready
    no later) and, with F = I = W, optimal under that memory: the last
    stage may hold one microbatch, so it runs F I W back to back from
    (p-1)F on, and its last I still has to climb p - 1 stages. Bubble:
    (p-1)(F+I) against 1F1B's (p-1)(F+I+W).

    The paper's ZB-H1 reaches (p-1)(F+I-W) by also delaying W's in the
    steady phase: stage s keeps s more microbatches that await only W, which
    the paper counts as cheap (weight-gradient inputs only). Under this
    project's memory model that order holds p microbatches on every stage.
    Delaying W's only in the cool-down does not pay off either: it is no
    faster with equal stages and can lose to 1F1B when a stage's W is long.
    """
    _check_shape(stages, microbatches)
    orders = tuple(_one_f_one_b_order(microbatches, min(stages - s, microbatches), split=True) for s in range(stages))
    return Schedule(ScheduleName.ZB_H1, orders)


def zb_h2(stages: int, microbatches: int) -> Schedule:
    """ZB-H2 (Qi et al., ICLR 2024): trade memory for a near-zero bubble.

    Stage s runs min(2(p - s) - 1, m) forwards before its first I: with
    F = I = W exactly enough to stay busy until the first gradient returns,
    so the only start-up idle is the unavoidable s * F. Each W trails its I
    by s backwards, so the later stages' final I's are not held up by W's
    and the gradient chain drains without waiting.
    With F = I = W and m >= p the makespan is the last stage's start
    (p-1)F plus its work m(F+I+W). Stage s holds at most 2p - 1 - s
    microbatches (from F start to W end).
    """
    _check_shape(stages, microbatches)
    orders = tuple(
        _one_f_one_b_order(microbatches, min(2 * (stages - s) - 1, microbatches), split=True, weight_lag=s)
        for s in range(stages)
    )
    return Schedule(ScheduleName.ZB_H2, orders)


def interleaved_1f1b(stages: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B over v chunks per stage (chunk c of stage s = virtual stage c*p + s).

    Forwards go through the microbatches group by group: a group of g
    microbatches runs chunk 0, then chunk 1, ...; backwards follow the same
    table with the chunks reversed. Stage s warms up with
    2(p - s - 1) + (v - 1)g forwards (capped at m*v), then alternates one
    forward and one backward, then drains the backwards. With m >= p,
    splitting a stage into v chunks divides the bubble by v, at the price of
    v times the p2p transfers and more warm-up memory.

    m % p == 0: groups of p, Megatron-core's default order. Otherwise the
    groups are `interleaved_group_sizes`: when they are equal this is PyTorch's
    ScheduleInterleaved1F1B (which rejects m that does not split into equal
    groups); Megatron-core instead takes one group size N in [p, m] and a
    leftover group of 0 or >= p, and rejects m < p. Every m >= 1 gives a
    deadlock-free order here (checked for p <= 16, m <= 64, v <= 4); for
    m < p it is one group, so microbatches simply stream through the p*v
    virtual stages.
    """
    _check_shape(stages, microbatches)
    if virtual_stages < 2:
        raise ScheduleError(f"interleaved 1F1B needs at least 2 chunks per stage, got {virtual_stages}; use 1F1B")
    p, v = stages, virtual_stages
    groups = interleaved_group_sizes(microbatches, p)
    table, first = [], 0
    for size in groups:
        table.extend((mb, chunk) for chunk in range(v) for mb in range(first, first + size))
        first += size
    forwards = [Op(FORWARD, mb, chunk) for mb, chunk in table]
    backwards = [Op(BACKWARD, mb, v - 1 - chunk) for mb, chunk in table]
    total = len(table)
    orders = []
    for s in range(p):
        warmup = min(2 * (p - s - 1) + (v - 1) * groups[0], total)
        ops = forwards[:warmup]
        for k in range(total - warmup):
            ops += [forwards[warmup + k], backwards[k]]
        ops += backwards[total - warmup:]
        orders.append(tuple(ops))
    return Schedule(ScheduleName.INTERLEAVED, tuple(orders))


def looped_bfs(stages: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Breadth-first pipeline parallelism (Lamy-Poirier, 2022), PyTorch's ScheduleLoopedBFS.

    The looped placement of interleaving (chunk c of stage s = virtual stage c*p + s), but each stage runs
    chunk 0's forward of every microbatch, then chunk 1's, and so on; then the backwards chunk by chunk
    in reverse, microbatches last-in first-out within a chunk (PyTorch's order). The bubble is the
    interleaved one's; the gain is elsewhere: a stage's last chunk finishes all its backwards first,
    so the data-parallel gradient sync of each finished chunk runs under the backward of the chunks
    before it (`planner.schedules.sync`). The price is memory: a stage holds every microbatch's
    activations of every chunk before its first backward, m layer sets, as GPipe.
    """
    _check_shape(stages, microbatches)
    if virtual_stages < 2:
        raise ScheduleError(f"looped BFS needs at least 2 chunks per stage, got {virtual_stages}; use gpipe")
    m, v = microbatches, virtual_stages
    forwards = tuple(Op(FORWARD, mb, chunk) for chunk in range(v) for mb in range(m))
    backwards = tuple(Op(BACKWARD, mb, chunk) for chunk in reversed(range(v)) for mb in reversed(range(m)))
    return Schedule(ScheduleName.LOOPED_BFS, (forwards + backwards,) * stages)


SINGLE_CHUNK_NAMES = (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.ZB_H1, ScheduleName.ZB_H2)
CHUNKED_NAMES = (ScheduleName.INTERLEAVED, ScheduleName.LOOPED_BFS)


def handcrafted_names(virtual_stages: int) -> tuple[str, ...]:
    """Names of the handcrafted schedules for stages of `virtual_stages` chunks, in `handcrafted_schedules` order."""
    return CHUNKED_NAMES if virtual_stages > 1 else SINGLE_CHUNK_NAMES


def handcrafted_schedule(name: str, stages: int, microbatches: int, virtual_stages: int) -> Schedule:
    """One handcrafted schedule by name (see `handcrafted_names`)."""
    if name == ScheduleName.INTERLEAVED:
        return interleaved_1f1b(stages, microbatches, virtual_stages)
    if name == ScheduleName.LOOPED_BFS:
        return looped_bfs(stages, microbatches, virtual_stages)
    builders = {ScheduleName.GPIPE: gpipe, ScheduleName.ONE_F_ONE_B: one_f_one_b, ScheduleName.ZB_H1: zb_h1, ScheduleName.ZB_H2: zb_h2}
    if name not in builders or virtual_stages > 1:
        raise ScheduleError(f"no handcrafted schedule {name!r} for {virtual_stages} chunks per stage")
    return builders[name](stages, microbatches)


def handcrafted_schedules(spec: PipelineSpec) -> tuple[Schedule, ...]:
    """Every handcrafted schedule that fits the spec's shape.

    Chunks placed for interleaving (v > 1) run the interleaved and the
    looped breadth-first orders; a single chunk per stage runs all the others.
    """
    p, m, v = spec.num_stages, spec.num_microbatches, spec.virtual_stages
    return tuple(handcrafted_schedule(name, p, m, v) for name in handcrafted_names(v))
