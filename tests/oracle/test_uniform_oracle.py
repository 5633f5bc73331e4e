"""The stock uniform planner against the exhaustive oracle, on 60 small instances.

`tests/oracle/enumerator.py` estimates every layout of the space `allow_non_uniform: false` declares
through `/v1/estimate`; the plan must be that optimum (within 0.1%, the figures' rounding), proven
optimal, and its solver report must be in the number it reports: objective = 1000 x the predicted
iteration time, the bound at most that. Mutation runs that made this fail are in BENCHMARKS.md
("Uniform plans against an exhaustive oracle").

The failure-aware plan of the same request (`allow_non_uniform: true`) searches a space that holds every
stock layout, so it must be at least as fast as the oracle's optimum, and its bound (on every layout of
that space) must not exceed it.
"""

from __future__ import annotations

import random

import pytest

from tests.oracle.checks import check_plans_against
from tests.oracle.enumerator import instance, oracle_best

INSTANCES = 60
SEED = 16


def _instances() -> list[dict]:
    rng = random.Random(SEED)
    return [instance(rng) for _ in range(INSTANCES)]


@pytest.mark.parametrize("body", _instances(), ids=[f"instance-{i}" for i in range(INSTANCES)])
def test_the_stock_plan_is_the_oracles_optimum(body: dict) -> None:
    check_plans_against(body, *oracle_best(body))
