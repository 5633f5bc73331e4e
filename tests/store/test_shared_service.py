"""Several service instances on one store: two `resiplan serve` processes started at once on an empty
database (both create the schema), each reading what the other answered."""

from __future__ import annotations

import httpx

from tests.api.support import small_request
from tests.service_process import served


def test_two_servers_started_together_share_every_plan(store_url, tmp_path):
    with served(store_url, tmp_path / "servers.log", count=2) as [first, second], httpx.Client(timeout=60) as client:
        planned = client.post(f"{first.base_url}/v1/plan", json=small_request())
        estimated = client.post(f"{second.base_url}/v1/estimate", json=small_request(layout={"tp": 2, "pp": 2}))
        assert planned.status_code == 200, planned.text
        assert estimated.status_code == 200, estimated.text
        plan, estimate = planned.json(), estimated.json()
        assert client.get(f"{second.base_url}/v1/plans/{plan['plan_id']}").json() == plan
        assert client.get(f"{first.base_url}/v1/plans/{estimate['plan_id']}").json() == estimate
        # And a plan made by one exports through the other (the export reads the shared row).
        exported = client.get(f"{second.base_url}/v1/plans/{plan['plan_id']}/export/json")
        assert exported.status_code == 200, exported.text
