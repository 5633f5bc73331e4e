"""The README's trainer-adapter scenario: a stock plan that all three trainers accept, from the same request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters.registry import export_format
from api.tasks.planning import plan_for
from wire.schemas import PlanRequest

REQUEST = Path(__file__).resolve().parents[2] / "docs" / "stock-request.json"


@pytest.fixture(scope="module")
def plan():
    return plan_for(PlanRequest.model_validate(json.loads(REQUEST.read_text())))


def test_readme_scenario_is_a_stock_plan(plan):
    assert plan.uniform and plan.schedule in {"1f1b", "interleaved", "gpipe"}
    assert "1:7" in plan.excluded_devices


@pytest.mark.parametrize("fmt", ["megatron", "deepspeed", "torchtitan"])
def test_every_trainer_exports_the_readme_scenario(plan, fmt):
    text = export_format(fmt).render(plan, None)
    pp = len(plan.replicas[0].stages)
    if fmt == "megatron":
        assert f"--pipeline-model-parallel-size {pp}" in text
    elif fmt == "deepspeed":
        assert json.loads(text)["resiplan"]["pipeline_module"]["num_stages"] == pp
    else:
        assert f"--parallelism.pipeline_parallel_degree {pp}" in text
