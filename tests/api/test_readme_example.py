"""The README's curl example: it plans, satisfies every invariant, and leaves the slow GPU out.

Also a regression test: this request mixes TP sizes inside replicas, which once
made templates cached across outer choices collide (a base group under one TP
size is a degraded one under another) and crashed assembly.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.api.support import verify_plan

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "example-request.json"


def test_readme_example_plans_and_satisfies_the_invariants(client):
    body = json.loads(EXAMPLE.read_text())
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 200, response.text
    plan = verify_plan(response.json(), body)
    assert "1:7" in plan.excluded_devices
    used = {d for r in plan.replicas for s in r.stages for d in s.devices}
    # A half-speed GPU would set the pace of its whole TP group and pipeline.
    assert "0:3" not in used
    # What the README shows: the stock search's single-GPU stages, 3.681 s, faster than the 3.829 s mixed-TP
    # layout the bubble-model search alone chose.
    assert {s.tp for r in plan.replicas for s in r.stages} == {1}
    assert plan.predicted.iteration_time_s <= 3.829442 * (1 - 0.03)
