"""Context parallelism against the exhaustive oracle (`tests/oracle/enumerator.py`: every stock layout, every
cp up to the request's `max_context_parallel`, estimated through `/v1/estimate`, sharing no code with the
search).

The instances ask for CP explicitly (`options.max_context_parallel` 2, 4 or 8) on the oracle's small clusters,
so the search must find the optimum over layouts with and without CP: the CP sizes it tries, its CP groups
spanning nodes, and the shapes it leaves out as dominated (cp dividing the micro-batch size) all face every
layout the contract allows. The failure-aware plan of the same request must be at least as fast.
"""

from __future__ import annotations

import random

import pytest

from tests.oracle.checks import check_plans_against
from tests.oracle.enumerator import instance, oracle_best

INSTANCES = 8
SEED = 1919


def _instances() -> list[dict]:
    rng = random.Random(SEED)
    bodies = []
    for _ in range(INSTANCES):
        body = instance(rng)
        bodies.append({**body, "options": {**body["options"], "max_context_parallel": rng.choice([2, 4, 8])},
                       "training": {**body["training"], "seq_length": rng.choice([2048, 8192])}})
    return bodies


@pytest.mark.parametrize("body", _instances(), ids=[f"instance-{i}" for i in range(INSTANCES)])
def test_the_stock_plan_with_cp_allowed_is_the_oracles_optimum(body: dict) -> None:
    plan = check_plans_against(body, *oracle_best(body))
    if plan is not None:
        assert max(stage.cp for stage in plan.replicas[0].stages) <= body["options"]["max_context_parallel"]


def test_the_instances_exercise_context_parallelism() -> None:
    """Guards what the instances were drawn for: in some of them the optimum splits sequences."""
    best = [oracle_best(body)[1] for body in _instances()[:4]]
    assert any(layout is not None and layout["cp"] > 1 for layout in best)
