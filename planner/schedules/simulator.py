"""Discrete-event simulation of a pipeline schedule.

Each stage runs its operations strictly in the given order, one at a time;
an operation starts when the stage is free and its inputs exist:

    F(mb, vs)      after F(mb, vs - 1)                  (+ p2p latency across stages)
    B|I(mb, vs)    after F(mb, vs) and B|I(mb, vs + 1)  (+ p2p latency across stages)
    W(mb, vs)      after I(mb, vs)

where vs is the virtual stage (chunk * stages + stage). The result is the
timeline every op actually gets, so the plan's iteration time and the
Gantt chart are the same numbers. A schedule that misses or repeats an
operation, or deadlocks (a stage waits for something that can only happen
after it), is rejected with the ops involved.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from planner.schedules.ops import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    OP_KINDS,
    WEIGHT_GRAD,
    Op,
    PipelineSpec,
    Schedule,
    ScheduleError,
    TimedOp,
)
from planner.schedules.sync import sync_shift_ms

# Keys of produced results: ("F", mb, vs) forward output, ("G", mb, vs) the
# gradient w.r.t. the virtual stage's input, ("W", mb, vs) its weight grads.
_GRADIENT = "G"


@dataclass(frozen=True)
class SimulationResult:
    makespan_ms: float
    timelines: tuple[tuple[TimedOp, ...], ...]
    busy_ms: tuple[float, ...]
    idle_ms: tuple[float, ...]
    peak_activation_gib: tuple[float, ...]
    peak_in_flight: tuple[int, ...]  # microbatch-chunks alive at once, per stage
    sync_shift_ms: float = 0.0  # what this schedule moves the exposed gradient sync by (`planner.schedules.sync`)

    @property
    def reported_ms(self) -> float:
        """What the plan's iteration time counts for this run beyond sync and optimizer as priced before
        schedules: the makespan, moved by the schedule's own sync exposure."""
        return self.makespan_ms + self.sync_shift_ms

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the busiest stage: the part of the makespan that is pipeline bubble."""
        if self.makespan_ms <= 0:
            return 0.0
        return 1.0 - max(self.busy_ms) / self.makespan_ms

    @property
    def bubble_ms(self) -> float:
        return self.makespan_ms - max(self.busy_ms)

    def over_memory(self, spec: PipelineSpec) -> tuple[int, ...]:
        """Stages whose peak activations exceed the spec's limit (tolerance 1e-9 GiB)."""
        if spec.activation_limit_gib is None:
            return ()
        return tuple(
            s for s, (peak, cap) in enumerate(zip(self.peak_activation_gib, spec.activation_limit_gib))
            if peak > cap + 1e-9
        )


def validate(schedule: Schedule, spec: PipelineSpec) -> None:
    """Every (microbatch, chunk) of every stage runs F once and B once, or I once and W once."""
    if len(schedule.orders) != spec.num_stages:
        raise ScheduleError(f"schedule {schedule.name!r} has {len(schedule.orders)} stages, the pipeline {spec.num_stages}")
    m, v = spec.num_microbatches, spec.virtual_stages
    for stage, order in enumerate(schedule.orders):
        # Plain tuples, not Ops: hashing dataclasses dominated simulating long orders.
        counts: dict[tuple[str, int, int], int] = {}
        for op in order:
            key = (op.kind, op.microbatch, op.chunk)
            counts[key] = counts.get(key, 0) + 1
        for (kind, mb, chunk), count in counts.items():
            if kind not in OP_KINDS:
                raise ScheduleError(f"stage {stage}: {Op(kind, mb, chunk).label()} is not an F, B, I or W operation")
            if not (0 <= mb < m and 0 <= chunk < v):
                raise ScheduleError(f"stage {stage}: {Op(kind, mb, chunk).label()} is outside {m} microbatches x {v} chunks")
            if count > 1:
                raise ScheduleError(f"stage {stage}: {Op(kind, mb, chunk).label()} appears {count} times")
        seen = counts.keys()
        if len(seen) in (2 * m * v, 3 * m * v) and _complete(seen, m, v):
            continue
        for chunk in range(v):
            for mb in range(m):
                _check_complete(stage, seen, mb, chunk)


def _complete(seen: Collection[tuple[str, int, int]], m: int, v: int) -> bool:
    """Every (microbatch, chunk) has F and B, or F, I and W (the common case, checked at once)."""
    kinds = (FORWARD, BACKWARD) if len(seen) == 2 * m * v else (FORWARD, INPUT_GRAD, WEIGHT_GRAD)
    return all((kind, mb, chunk) in seen for kind in kinds for mb in range(m) for chunk in range(v))


def _check_complete(stage: int, seen: Collection[tuple[str, int, int]], mb: int, chunk: int) -> None:
    def has(kind: str) -> bool:
        return (kind, mb, chunk) in seen

    label = Op(FORWARD, mb, chunk).label()[1:]
    if not has(FORWARD):
        raise ScheduleError(f"stage {stage}: microbatch {label} has no forward F{label}")
    full, split_input, split_weight = has(BACKWARD), has(INPUT_GRAD), has(WEIGHT_GRAD)
    if full and (split_input or split_weight):
        raise ScheduleError(f"stage {stage}: microbatch {label} has both B and I/W")
    if not full and not (split_input and split_weight):
        missing = "B" if not (split_input or split_weight) else ("W" if split_input else "I")
        raise ScheduleError(f"stage {stage}: microbatch {label} has no {missing}{label}")


def simulate(schedule: Schedule, spec: PipelineSpec, validated: bool = False) -> SimulationResult:
    """Run the schedule; raise ScheduleError if it is incomplete or deadlocks. `validated`: the
    caller already validated this schedule for a spec of the same stages, microbatches and chunks
    (one order serves every replica of a shape; validating it costs a fifth of a simulation)."""
    if not validated:
        validate(schedule, spec)
    orders = schedule.orders
    p = spec.num_stages
    last = p * spec.virtual_stages - 1
    latency = spec.hop_latency_ms
    # Durations per stage, chunk and kind, read once: the loop below runs once per op.
    durations = [[{kind: chunk.duration_ms(kind) for kind in OP_KINDS} for chunk in chunks] for chunks in spec.chunks]
    position = [0] * p
    free_at = [0.0] * p
    done: dict[tuple, float] = {}
    timelines: list[list[TimedOp]] = [[] for _ in range(p)]
    waiting: dict[tuple, list[int]] = {}
    runnable = list(range(p))
    while runnable:
        stage = runnable.pop()
        order = orders[stage]
        while position[stage] < len(order):
            op = order[position[stage]]
            kind, mb, chunk = op.kind, op.microbatch, op.chunk
            vs = chunk * p + stage
            # Inputs (see the module docstring): the op waits for each result's key, `latency` more
            # for one from another virtual stage. Written out, not looped over: this runs per op.
            ready = free_at[stage]
            blocked_on = None
            if kind == FORWARD:
                produced = (FORWARD, mb, vs)
                if vs > 0:
                    key = (FORWARD, mb, vs - 1)
                    end = done.get(key)
                    if end is None:
                        blocked_on = key
                    else:
                        ready = max(ready, end + latency)
            elif kind == WEIGHT_GRAD:
                produced = (WEIGHT_GRAD, mb, vs)
                key = (_GRADIENT, mb, vs)
                end = done.get(key)
                if end is None:
                    blocked_on = key
                else:
                    ready = max(ready, end)
            else:
                produced = (_GRADIENT, mb, vs)
                key = (FORWARD, mb, vs)
                end = done.get(key)
                if end is None:
                    blocked_on = key
                else:
                    ready = max(ready, end)
                    if vs != last:
                        key = (_GRADIENT, mb, vs + 1)
                        end = done.get(key)
                        if end is None:
                            blocked_on = key
                        else:
                            ready = max(ready, end + latency)
            if blocked_on is not None:
                waiting.setdefault(blocked_on, []).append(stage)
                break
            end = ready + durations[stage][chunk][kind]
            timelines[stage].append(TimedOp(op, ready, end))
            free_at[stage] = end
            position[stage] += 1
            done[produced] = end
            runnable.extend(waiting.pop(produced, ()))
    stuck = [s for s in range(p) if position[s] < len(orders[s])]
    if stuck:
        detail = ", ".join(f"stage {s} waits at {orders[s][position[s]].label()}" for s in stuck[:4])
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: {detail}")
    return _summarize(tuple(tuple(t) for t in timelines), spec, schedule.name)


def _summarize(timelines: tuple[tuple[TimedOp, ...], ...], spec: PipelineSpec, name: str) -> SimulationResult:
    makespan = max((t[-1].end_ms for t in timelines if t), default=0.0)
    busy = tuple(sum(item.end_ms - item.start_ms for item in t) for t in timelines)
    peaks_gib, peaks_count = [], []
    for stage, timeline in enumerate(timelines):
        peak_gib, peak_count = _peak_activations(stage, timeline, spec)
        peaks_gib.append(peak_gib)
        peaks_count.append(peak_count)
    return SimulationResult(
        makespan_ms=makespan,
        timelines=timelines,
        busy_ms=busy,
        idle_ms=tuple(makespan - b for b in busy),
        peak_activation_gib=tuple(peaks_gib),
        peak_in_flight=tuple(peaks_count),
        sync_shift_ms=sync_shift_ms(name, spec, timelines, makespan),
    )


def _peak_activations(stage: int, timeline: tuple[TimedOp, ...], spec: PipelineSpec) -> tuple[float, int]:
    """Activations live from a forward's start until the microbatch's B (or W) ends.

    Ops on one stage never overlap, so walking the timeline in order and
    releasing at each B/W's end is exact.
    """
    alive_gib, alive, peak_gib, peak = 0.0, 0, 0.0, 0
    for item in timeline:
        op = item.op
        size = spec.chunks[stage][op.chunk].activation_gib
        if op.kind == FORWARD:
            alive_gib += size
            alive += 1
            peak_gib, peak = max(peak_gib, alive_gib), max(peak, alive)
        elif op.kind in (BACKWARD, WEIGHT_GRAD):
            alive_gib -= size
            alive -= 1
    return peak_gib, peak
