"""POST /v1/plans/{id}/replan over HTTP: parent, migration, stored chains, errors."""

from __future__ import annotations

from fractions import Fraction

import pytest

from tests.api.support import (
    assert_detail,
    estimate_request,
    small_request,
    verify_plan,
)
from wire.schemas import PlanRequest


# Tests that compare two answers to one failure state need searches that finish: the failure-aware search
# is cut by its work budget, and on a loaded machine (the solver pool's workers are niced) the wall-clock
# safety net may cut it elsewhere (`solver.stopped_by: wall clock`), so two equal requests could differ.
FINISHING = {"time_limit_s": 10, "allow_non_uniform": False}


def _plan(client, **overrides):
    body = small_request(**overrides)
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 200, response.text
    return body, response.json()


def test_replan_after_a_failure_returns_a_valid_plan_with_its_migration(client):
    body, parent = _plan(client, options=FINISHING)
    response = client.post(f"/v1/plans/{parent['plan_id']}/replan", json={"failures": {"failed": ["1:3"]}})
    assert response.status_code == 200, response.text
    child = response.json()
    verify_plan(child, {**body, "failures": {"failed": ["1:3"]}})
    assert child["parent_plan_id"] == parent["plan_id"] and child["plan_id"] != parent["plan_id"]
    assert child["excluded_devices"] == ["1:3"]
    migration = child["migration"]
    assert migration["chosen"] == "replan" and migration["amortize_iterations"] == 500
    assert 0 < migration["bytes_moved"] and migration["estimated_s"] > 0
    names = {c["name"]: c for c in migration["candidates"]}
    assert names["replan"]["bytes_moved"] == migration["bytes_moved"] <= names["scratch"]["bytes_moved"]
    # Stored: readable, and a replan of the replan chains from it.
    assert client.get(f"/v1/plans/{child['plan_id']}").json() == child
    again = client.post(f"/v1/plans/{child['plan_id']}/replan", json={"failures": {"failed": ["1:3"]}})
    assert again.status_code == 200
    assert again.json()["parent_plan_id"] == child["plan_id"]
    assert again.json()["migration"]["chosen"] == "keep" and again.json()["migration"]["bytes_moved"] == 0


def test_keeping_the_plan_updates_device_roles_to_the_failure_state_now(client):
    _, parent = _plan(client, cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB"},
                      failures={"failed": ["0:1"]}, options=FINISHING)
    unused = parent["unused_devices"]
    assert unused, "the scenario must leave a device unused (15 GPUs, TP groups of 2 or more)"
    response = client.post(f"/v1/plans/{parent['plan_id']}/replan",
                           json={"failures": {"failed": ["0:1", unused[0]]}})
    child = response.json()
    assert child["migration"]["chosen"] == "keep"
    assert child["replicas"] == parent["replicas"]
    assert sorted(child["excluded_devices"]) == sorted(["0:1", unused[0]])
    assert unused[0] not in child["unused_devices"]


def test_a_kept_plans_solver_report_is_this_answers():
    """Asked for 0.01 s, the replan says the limit it kept (raised, with the note why), its own wall time and an
    objective that is its predicted iteration; the status, gap and bound it keeps are named as the parent's."""
    from api.tasks.planning import plan_for
    from api.tasks.replanning import KEPT_NOTE, replan_for

    body = small_request(options=FINISHING)
    parent = plan_for(PlanRequest.model_validate(body))
    request = PlanRequest.model_validate({**body, "options": {**FINISHING, "time_limit_s": 0.01}})
    child = replan_for(request, parent, "kept-child")
    assert child.migration.chosen == "keep"
    assert child.solver.time_limit_s > 0.01 and child.solver.time_limit_s != parent.solver.time_limit_s
    assert any(note.startswith("time_limit_s 0.01 is below") for note in child.solver.notes)
    assert KEPT_NOTE in child.solver.notes
    assert [note for note in child.solver.notes if note.startswith("the parent's: ")] == [
        f"the parent's: {note}" for note in parent.solver.notes]
    assert child.solver.objective_ms == pytest.approx(1e3 * child.predicted.iteration_time_s, abs=1e-3)
    assert (child.solver.status, child.solver.gap, child.solver.bound_ms) == (
        parent.solver.status, parent.solver.gap, parent.solver.bound_ms)


def test_options_not_given_are_the_parents():
    from api.tasks.replanning import replan_request
    from wire.schemas import ReplanRequest

    parent = small_request(options={"time_limit_s": 1.5, "random_seed": 7, "allow_non_uniform": False})
    body = ReplanRequest.model_validate({"failures": {"failed": ["0:0"]}, "options": {"amortize_iterations": 20}})
    merged = replan_request(parent, body)
    assert merged.failures.failed == ["0:0"]
    assert (merged.options.time_limit_s, merged.options.random_seed, merged.options.allow_non_uniform) == (1.5, 7, False)
    assert merged.options.amortize_iterations == 20
    assert merged.cluster.model_dump() == PlanRequest.model_validate(parent).cluster.model_dump()


def test_the_amortization_asked_for_is_the_one_used(client):
    _, parent = _plan(client)
    response = client.post(f"/v1/plans/{parent['plan_id']}/replan",
                           json={"failures": {"failed": ["0:0"]}, "options": {"amortize_iterations": 20}})
    assert response.status_code == 200, response.text
    migration = response.json()["migration"]
    assert migration["amortize_iterations"] == 20
    for candidate in migration["candidates"]:
        expected = candidate["iteration_time_s"] * 1e3 + candidate["migration_s"] * 1e3 / 20
        assert abs(candidate["objective_ms"] - expected) < 0.05  # migration_s is rounded to 1 ms


def test_an_estimate_can_be_replanned(client):
    body = estimate_request({"tp": 2, "pp": 2, "micro_batch_size": 1})
    parent = client.post("/v1/estimate", json=body).json()
    response = client.post(f"/v1/plans/{parent['plan_id']}/replan", json={"failures": {"failed": ["2:*"]}})
    assert response.status_code == 200, response.text
    stripped = {k: v for k, v in body.items() if k != "layout"}
    verify_plan(response.json(), {**stripped, "failures": {"failed": ["2:*"]}})


def test_unknown_plan_is_404_and_bad_failures_are_422(client):
    missing = client.post("/v1/plans/no-such-plan/replan", json={"failures": {}})
    assert missing.status_code == 404
    assert "no-such-plan" in missing.json()["detail"]
    _, parent = _plan(client)
    out_of_range = client.post(f"/v1/plans/{parent['plan_id']}/replan", json={"failures": {"failed": ["9:0"]}})
    assert_detail(out_of_range, "9:0", "node 9")
    everything = client.post(f"/v1/plans/{parent['plan_id']}/replan", json={"failures": {"failed": ["0:*", "1:*"]}})
    assert everything.status_code == 422
    unknown_field = client.post(f"/v1/plans/{parent['plan_id']}/replan", json={"failurez": {}})
    assert unknown_field.status_code == 422
    bad_amortize = client.post(f"/v1/plans/{parent['plan_id']}/replan",
                               json={"failures": {}, "options": {"amortize_iterations": 0}})
    assert bad_amortize.status_code == 422


def test_the_client_replans_against_the_service(client):
    from adapters.client import PlannerClient

    _, parent = _plan(client)
    planner = PlannerClient(base_url="http://testserver", http=client)
    child = planner.replan(parent["plan_id"], {"failed": ["0:2"]}, {"amortize_iterations": 50})
    assert child.parent_plan_id == parent["plan_id"]
    assert child.migration is not None and child.migration.amortize_iterations == 50
    PlanRequest.model_validate(small_request())  # the client's request type is the service's


def _stage_of(plan: dict, device: str) -> dict:
    return next(stage for replica in plan["replicas"] for stage in replica["stages"] if device in stage["devices"])


def _held_layers(plan: dict, device: str) -> set[int]:
    """The layers `device` holds. With v > 1 chunks per stage (README, "Known limits"), a stage's `layers` range
    counts its layers in total, split evenly into its v chunks; chunk c of stage s is virtual stage c * p + s,
    and virtual stages take the layers in order (Megatron's interleaved placement)."""
    v = plan["virtual_stages"]
    replica = next(r for r in plan["replicas"] if any(device in s["devices"] for s in r["stages"]))
    stages = replica["stages"]
    chunk = [(s["layers"][1] - s["layers"][0]) // v for s in stages]
    held, start = {}, 0
    for c in range(v):
        for s, stage in enumerate(stages):
            held.setdefault(s, set()).update(range(start, start + chunk[s]))
            start += chunk[s]
    return next(held[s] for s, stage in enumerate(stages) if device in stage["devices"])


def test_replan_lists_every_transfer_and_they_add_up_to_the_totals(client):
    body, parent = _plan(client)
    child = client.post(f"/v1/plans/{parent['plan_id']}/replan",
                        json={"failures": {"failed": ["1:3"], "slow": [{"device": "0:1", "speed": 0.5}]}}).json()
    migration = child["migration"]
    transfers = migration["transfers"]
    assert transfers and sum(t["bytes"] for t in transfers) == pytest.approx(migration["bytes_moved"], abs=len(transfers))
    num_layers = parent["replicas"][0]["stages"][-1]["layers"][1]
    for t in transfers:
        assert set(t) >= {"from", "to", "layers", "tp_shard", "part", "state", "bytes"}
        assert t["from"] != "1:3" and t["from"] != t["to"]
        receiver = _stage_of(child, t["to"])
        first, last = t["layers"]
        # The sender held those layers, the receiver holds them now, in the shard it names.
        assert first < last and set(range(first, last)) <= _held_layers(parent, t["from"])
        assert set(range(first, last)) <= _held_layers(child, t["to"])
        assert t["tp_shard"] == [receiver["devices"].index(t["to"]), receiver["tp"]]
        lo, hi, of = t["part"]
        rank, tp = t["tp_shard"]
        assert Fraction(rank, tp) <= Fraction(lo, of) < Fraction(hi, of) <= Fraction(rank + 1, tp)
        assert not t["embedding"] or receiver["layers"][0] == 0
        assert not t["head"] or receiver["layers"][1] == num_layers
        assert t["intra_node"] == (t["from"].split(":")[0] == t["to"].split(":")[0])
    assert {t["to"] for t in transfers} <= set(migration["devices_changed"])
