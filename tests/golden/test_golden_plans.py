"""The sample requests plan exactly as they did when tests/golden/plans/ was written (before the package
layout moved): the moves and renames changed no behaviour. Clock fields (ids, wall times) are left out;
every request gets a time limit far above its solve time, so the proven answer is compared."""

from __future__ import annotations

import json

import pytest

from tests.golden.golden import REQUESTS, golden_path, golden_request, plan_json


@pytest.mark.parametrize("request_path", REQUESTS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_the_sample_request_plans_as_the_golden_plan(request_path):
    golden = json.loads(golden_path(request_path).read_text())
    assert plan_json(golden_request(request_path)) == golden
