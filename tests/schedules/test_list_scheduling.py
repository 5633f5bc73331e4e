"""The greedy list scheduler against its definition, rescanning every stage at every step.

`list_schedule` keeps one candidate per stage in a heap and, after an op,
recomputes only the stages whose next op it can enable (its own, and the
one consuming its result); the reference below recomputes every stage's
candidate before every pick, so any missed update shows up as a different
order or makespan.
"""

from __future__ import annotations

import random

import pytest

from planner.schedules.list_scheduling import list_schedule
from planner.schedules.ops import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    ChunkTimes,
    Op,
    PipelineSpec,
    op_kinds,
)
from planner.schedules.simulator import simulate


def naive_list_schedule(spec, split, priority, limit):
    """(orders, makespan): start the op that can start earliest anywhere, ties as `list_schedule`."""
    p, v, m = spec.num_stages, spec.virtual_stages, spec.num_microbatches
    V, L = p * v, spec.hop_latency_ms
    back = INPUT_GRAD if split else BACKWARD
    release = WEIGHT_GRAD if split else BACKWARD
    kinds = op_kinds(split)
    memory = [spec.memory_units(s) for s in range(p)]
    free, held, alive = [0.0] * p, [0] * p, [0] * p
    following = {(kind, s, c): 0 for kind in kinds for s in range(p) for c in range(v)}
    end = {}
    orders = [[] for _ in range(p)]

    def ready(kind, mb, vs):
        if kind == FORWARD:
            return 0.0 if vs == 0 else (None if (mb, vs - 1, FORWARD) not in end else end[mb, vs - 1, FORWARD] + L)
        if kind == WEIGHT_GRAD:
            return end.get((mb, vs, INPUT_GRAD))
        own = end.get((mb, vs, FORWARD))
        if own is None or vs == V - 1:
            return own
        later = end.get((mb, vs + 1, back))
        return None if later is None else max(own, later + L)

    while True:
        best = None
        for s in range(p):
            for c in range(v):
                for kind in kinds:
                    mb = following[kind, s, c]
                    if mb >= m:
                        continue
                    if kind == FORWARD:
                        if memory[s] is not None and held[s] + memory[s][0][c] > memory[s][1]:
                            continue
                        if limit is not None and alive[s] >= limit[s]:
                            continue
                    at = ready(kind, mb, c * p + s)
                    if at is not None:
                        key = (max(free[s], at), priority.index(kind), mb, s, c, kind)
                        best = key if best is None or key < best else best
        if best is None:
            break
        at, _, mb, s, c, kind = best
        finish = at + spec.chunks[s][c].duration_ms(kind)
        end[mb, c * p + s, kind] = free[s] = finish
        following[kind, s, c] += 1
        orders[s].append(Op(kind, mb, c))
        if kind == FORWARD:
            held[s] += memory[s][0][c] if memory[s] is not None else 0
            alive[s] += 1
        if kind == release:
            held[s] -= memory[s][0][c] if memory[s] is not None else 0
            alive[s] -= 1
    if sum(map(len, orders)) < p * v * m * len(kinds):
        return None
    return tuple(map(tuple, orders)), max(free)


def random_spec(rng):
    p, v, m = rng.choice([1, 2, 3, 4, 6]), rng.choice([1, 1, 2, 3]), rng.choice([1, 2, 3, 5, 8, 13])
    chunks = tuple(
        tuple(ChunkTimes(rng.uniform(0.5, 2), rng.uniform(0.5, 2), rng.uniform(0, 2), rng.uniform(0.5, 1.5))
              for _ in range(v))
        for _ in range(p)
    )
    cap = None if rng.random() < 0.4 else tuple(rng.uniform(1.5, 3 * p) for _ in range(p))
    return PipelineSpec(chunks, m, rng.choice([0.0, 0.05]), cap)


@pytest.mark.parametrize("seed", range(40))
def test_list_schedule_matches_rescanning_every_stage(seed):
    rng = random.Random(seed)
    spec = random_spec(rng)
    p, v = spec.num_stages, spec.virtual_stages
    for split in (False, True):
        back = INPUT_GRAD if split else BACKWARD
        for priority in ((back, FORWARD, WEIGHT_GRAD)[: 2 + split], (FORWARD, back, WEIGHT_GRAD)[: 2 + split]):
            for limit in (None, [v * (p - s) for s in range(p)]):
                start = list_schedule(spec, split, priority, limit)
                expected = naive_list_schedule(spec, split, priority, limit)
                if expected is None:
                    assert start is None
                    continue
                assert start.schedule.orders == expected[0]
                assert start.makespan_ms == expected[1]
                assert simulate(start.schedule, spec).makespan_ms == start.makespan_ms
