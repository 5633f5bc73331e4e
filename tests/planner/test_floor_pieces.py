"""The simulation floors the failure-aware search prices templates by (`floor_pieces`) are floors: no
handcrafted schedule simulates a template faster, for any microbatch count, on damaged clusters of every
kind the oracle instances draw. The bound a failure-aware plan reports rests on this (issue 16).

The check runs each template through the simulator (`planner.schedules.simulator`), which shares nothing
with how the pieces are derived (from `planner.schedules.bounds`' terms). Mutation: dropping the rounding
down of the offsets, or counting the backward chain when zero-bubble schedules are allowed, fails it."""

from __future__ import annotations

import random

import pytest

from cost_models.iteration import stage_time
from planner.assemble import stage_figures
from planner.config import TIME_QUANTUM_MS
from planner.nonuniform.allocation.input import need
from planner.nonuniform.partitions import StageType
from planner.nonuniform.outer_bounds import build_inventory
from planner.nonuniform.search import _memory_replicas, outer_choices
from planner.nonuniform.templates import TermsCache, enumerate_templates, floor_pieces
from planner.result import ReplicaResult, StageResult
from planner.schedules.bounds import FULL_BACKWARD
from planner.schedules.build import replica_spec
from planner.schedules.handcrafted import handcrafted_names, handcrafted_schedule
from planner.schedules.simulator import simulate
from planner.uniform.candidates import tensor_parallel_sizes
from tests.oracle.enumerator import instance, with_failures
from wire.convert import to_problem
from wire.schemas import PlanRequest

SEED = 7
INSTANCES = 12
MICROBATCHES = (1, 2, 3, 5, 8)


def _problems():
    rng = random.Random(SEED)
    out = []
    for _ in range(INSTANCES):
        body = with_failures(rng, instance(rng))
        body["options"] = {**body["options"], "allow_non_uniform": True}
        out.append(body)
    return out


def _spec(problem, cache, template, microbatches, v):
    stages = len(template.stage_types)
    figures = [
        StageResult(id=i, layers=(0, 0), devices=(), tp=st.tp, speed=st.speed,
                    **stage_figures(stage_time(cache.terms(st.tp, stages), i, n, st.speed)))
        for i, (st, n) in enumerate(zip(template.stage_types, template.layers_per_stage))
    ]
    replica = ReplicaResult(id=0, num_microbatches=microbatches, stages=tuple(figures))
    return replica_spec(replica, v, problem.usable_memory_gib)


@pytest.mark.parametrize("body", _problems(), ids=[f"instance-{i}" for i in range(INSTANCES)])
def test_no_handcrafted_schedule_beats_a_templates_floor(body):
    problem = to_problem(PlanRequest.model_validate(body))
    sizes = tensor_parallel_sizes(problem)
    checked = 0
    for outer in outer_choices(problem)[::7]:  # a spread of outer choices keeps this fast
        inventory = build_inventory(problem, outer.tp, sizes, outer.cp)
        cache = TermsCache(problem, outer, _memory_replicas(problem, outer, inventory))
        templates = enumerate_templates(problem, outer, cache, inventory.degraded_types(), 2)
        v = outer.virtual_stages
        for template in templates[:6]:
            for full_backward in (True, False):
                pieces = floor_pieces(template, v, full_backward)
                names = handcrafted_names(v)
                if full_backward:
                    names = tuple(name for name in names if name in FULL_BACKWARD)
                for m in MICROBATCHES:
                    floor_ms = need(pieces, m) * TIME_QUANTUM_MS / v
                    spec = _spec(problem, cache, template, m, v)
                    for name in names:
                        makespan = simulate(handcrafted_schedule(name, spec.num_stages, m, v), spec).makespan_ms
                        # The plan's stage times are rounded to 1 us (as on the wire): allow that per op.
                        slack = 1e-3 * 3 * spec.num_stages * v * m
                        assert makespan >= floor_ms - slack, (
                            f"{name} runs {template.stage_types} {template.layers_per_stage} x{m} in {makespan} ms, "
                            f"below its floor {floor_ms} ms")
                        checked += 1
    assert checked > 0 or not outer_choices(problem)
