"""The README's curl example: it plans, satisfies every invariant, and gives the half-speed GPU less work.

Also a regression test: this request mixes TP sizes inside replicas, which once
made templates cached across outer choices collide (a base group under one TP
size is a degraded one under another) and crashed assembly.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.api.support import verify_plan

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "example-request.json"
SLOW = "0:3"


def test_readme_example_plans_and_satisfies_the_invariants(client):
    body = json.loads(EXAMPLE.read_text())
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 200, response.text
    plan = verify_plan(response.json(), body)
    assert "1:7" in plan.excluded_devices
    # A half-speed GPU must not set the pace: where it is used, its stage holds fewer layers than every
    # full-speed stage of its TP size in the same place of a pipeline (the first holds the embedding, the last
    # the head), and its replica takes no more microbatches than any other.
    def place(replica, index):
        return "only" if len(replica.stages) == 1 else ("first" if index == 0 else
                                                        "last" if index == len(replica.stages) - 1 else "middle")

    stages = [(r, i, s) for r in plan.replicas for i, s in enumerate(r.stages)]
    slow = [(r, i, s) for r, i, s in stages if SLOW in s.devices]
    assert slow
    for replica, index, stage in slow:
        width = stage.layers[1] - stage.layers[0]
        peers = [s.layers[1] - s.layers[0] for r, i, s in stages
                 if s.tp == stage.tp and SLOW not in s.devices and place(r, i) == place(replica, index)]
        assert peers and width < min(peers)
        assert replica.num_microbatches <= min(r.num_microbatches for r in plan.replicas)
    # What the README shows beside it: using the slow GPU beats leaving it out, here the 14 other healthy
    # GPUs as two 7-stage pipelines of single GPUs (the answer before the all-gather overlap was priced; ZB-H1
    # here, the best named schedule that fits its memory).
    left_out = {"replicas": [{"num_microbatches": 32, "stages": [
        {"devices": [f"{node}:{gpu}"], "layers": [start, min(start + 5, 32)]}
        for gpu, start in zip([g for g in range(8) if f"{node}:{g}" not in (SLOW, "1:7")], range(0, 35, 5))]}
        for node in (0, 1)], "micro_batch_size": 1, "schedule": "zb-h1"}
    estimate = client.post("/v1/estimate", json={**body, "layout": left_out})
    assert estimate.status_code == 200, estimate.text
    assert plan.predicted.iteration_time_s < estimate.json()["predicted"]["iteration_time_s"]
