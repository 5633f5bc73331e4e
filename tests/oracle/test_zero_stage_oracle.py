"""ZeRO-2, ZeRO-3 and `zero_stage: auto` against the exhaustive oracle (`tests/oracle/enumerator.py`, every
stock layout estimated through `/v1/estimate`, sharing no code with the search).

At a given stage 2 or 3 the plan must be the oracle's optimum over that stage's stock layouts, proven. With
`auto` the plan must be the least of the oracle's optima at stages 1, 2 and 3, and proven over their union.
"""

from __future__ import annotations

import random

import pytest

from api.tasks.planning import plan_for
from tests.oracle.checks import TOLERANCE, check_plans_against
from tests.oracle.enumerator import instance, oracle_best
from wire.schemas import PlanRequest

SEED = 19
STAGE_INSTANCES = 10
AUTO_INSTANCES = 6


def _with_zero(body: dict, stage: int | str) -> dict:
    return {**body, "training": {**body["training"], "zero_stage": stage}}


def _stage_instances() -> list[dict]:
    rng = random.Random(SEED)
    return [_with_zero(instance(rng), rng.choice([2, 3])) for _ in range(STAGE_INSTANCES)]


def _auto_instances() -> list[dict]:
    rng = random.Random(SEED + 1)
    return [_with_zero(instance(rng), "auto") for _ in range(AUTO_INSTANCES)]


@pytest.mark.parametrize("body", _stage_instances(), ids=[f"instance-{i}" for i in range(STAGE_INSTANCES)])
def test_a_zero_2_or_3_plan_is_the_oracles_optimum_at_that_stage(body: dict) -> None:
    plan = check_plans_against(body, *oracle_best(body))
    if plan is not None:
        assert plan.zero_stage == body["training"]["zero_stage"]


@pytest.mark.parametrize("body", _auto_instances(), ids=[f"instance-{i}" for i in range(AUTO_INSTANCES)])
def test_auto_is_the_least_of_the_oracles_optima_over_stages_1_to_3(body: dict) -> None:
    optima = {stage: oracle_best(_with_zero(body, stage)) for stage in (1, 2, 3)}
    fitting = {stage: best_s for stage, (best_s, layout) in optima.items() if layout is not None}
    if not fitting:
        pytest.fail("no stage fits: the instance does not exercise the choice")
    best_s = min(fitting.values())
    plan = plan_for(PlanRequest.model_validate(body))
    assert plan.predicted.iteration_time_s == pytest.approx(best_s, rel=TOLERANCE)
    assert fitting[plan.zero_stage] == pytest.approx(best_s, rel=TOLERANCE)
    assert plan.solver.status == "OPTIMAL"
    assert plan.solver.bound_ms <= 1e3 * plan.predicted.iteration_time_s * (1 + 1e-6)
