"""The stock planner on damaged clusters against the exhaustive placement oracle, on 60 small instances.

`tests/oracle/placed.py` estimates, through `/v1/estimate` with every replica spelled out, every stock
layout with its slow GPUs in every place (unused, or any replica and stage, two of one node together or
apart); the plan must be that optimum (within 0.1%), proven optimal, its solver report in the number it
reports, and its ranks launchable (each node one block in the rank order stock trainers use).
Planning with the slow GPUs always packed into the fewest replicas, or always spread one per replica,
or without the launch-order check, fails some of these (mutation runs in BENCHMARKS.md, "Oracle
mutation runs").

The failure-aware plan of the same request searches a space holding every stock layout: it must be at
least as fast as the oracle's optimum, and its bound must not exceed it.
"""

from __future__ import annotations

import random

import pytest

from adapters.stock import node_blocks
from tests.oracle.checks import check_plans_against
from tests.oracle.placed import damaged_instance, placed_oracle_best

_RNG = random.Random(3)
BODIES = [damaged_instance(_RNG) for _ in range(60)]


@pytest.mark.parametrize("body", BODIES, ids=[f"damaged-{i}" for i in range(len(BODIES))])
def test_the_stock_plan_places_slow_gpus_as_the_oracle_does(body: dict) -> None:
    plan = check_plans_against(body, *placed_oracle_best(body))
    if plan is not None:
        # Launchable as stock trainers number ranks (tp, then dp, then pp; torchrun node by node).
        ranks = [device for stage in range(len(plan.replicas[0].stages)) for replica in plan.replicas
                 for device in replica.stages[stage].devices]
        assert node_blocks(ranks) is not None, f"a node's ranks are split: {ranks}"
