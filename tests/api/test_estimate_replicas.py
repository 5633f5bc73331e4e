"""POST /v1/estimate with `layout.replicas`: any layout the planner can return, priced without a search."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tests.api.support import assert_detail, assert_validation, verify_plan

HANDCRAFTED = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"]
GQA_MODEL = {"num_layers": 14, "hidden_size": 4096, "ffn_hidden_size": 11008, "num_attention_heads": 32,
             "num_kv_heads": 8, "vocab_size": 32000}
EXAMPLES = Path(__file__).resolve().parents[2] / "api" / "examples"


def _small(failures: dict) -> dict:
    return {"cluster": {"num_nodes": 2, "gpus_per_node": 4, "gpu": "A100-40GB"}, "model": GQA_MODEL,
            "failures": failures, "training": {"global_batch_size": 16, "seq_length": 2048},
            "options": {"schedules": HANDCRAFTED}}


def _example(name: str) -> dict:
    body = json.loads((EXAMPLES / name).read_text())
    body["options"] = {**body.get("options", {}), "schedules": HANDCRAFTED}
    return body


def layout_of(plan: dict) -> dict:
    """The plan's layout as an estimate's `layout.replicas`: devices and layers of every stage."""
    return {
        "micro_batch_size": plan["micro_batch_size"], "virtual_stages": plan["virtual_stages"],
        "schedule": plan["schedule"], "recompute": plan["recompute"],
        "replicas": [{"num_microbatches": r["num_microbatches"],
                      "stages": [{"devices": s["devices"], "layers": s["layers"]} for s in r["stages"]]}
                     for r in plan["replicas"]],
    }


@pytest.mark.parametrize("request_body", [
    _small({"failed": ["1:2"]}),  # one replica whose stages have TP 2, 1, 2, 2, interleaved
    _small({"slow": [{"device": "1:1", "speed": 0.5}]}),
    _small({}),
    _example("slow-64xh100-llama3-8b.json"),  # non-uniform replicas
    _example("mixed-256xa100-qwen2.5-32b.json"),
], ids=["failed", "slow", "healthy", "slow-64xh100", "mixed-256xa100"])
def test_a_plans_own_replicas_estimate_to_the_plans_prediction(client, request_body) -> None:
    """The estimate prices a layout with the cost model the search used: fed a plan's replicas it must
    predict the plan's own iteration time, stage times and memory (a planner and an estimate that
    priced layouts differently would let an oracle built on estimates disagree with every plan)."""
    planned = client.post("/v1/plan", json=request_body)
    assert planned.status_code == 200, planned.text
    plan = planned.json()
    body = {**copy.deepcopy(request_body), "layout": layout_of(plan)}
    response = client.post("/v1/estimate", json=body)
    assert response.status_code == 200, response.text
    estimate = verify_plan(response.json(), body)
    assert estimate.predicted.iteration_time_s == pytest.approx(plan["predicted"]["iteration_time_s"], rel=1e-6)
    assert estimate.uniform == plan["uniform"]
    for ours, theirs in zip(estimate.replicas, plan["replicas"]):
        assert ours.num_microbatches == theirs["num_microbatches"]
        for stage, original in zip(ours.stages, theirs["stages"]):
            assert stage.devices == original["devices"]
            assert (stage.forward_ms, stage.backward_ms, stage.memory_gib) == pytest.approx(
                (original["forward_ms"], original["backward_ms"], original["memory_gib"]), rel=1e-6)


def _request(layout: dict) -> dict:
    return {**_small({"failed": ["1:3"]}), "layout": layout}


def _replicas(*replicas: tuple[int, list[tuple[list[str], tuple[int, int]]]]) -> list[dict]:
    return [{"num_microbatches": m, "stages": [{"devices": d, "layers": list(l)} for d, l in stages]}
            for m, stages in replicas]


def test_a_slow_stage_is_priced_at_its_slowest_member(client) -> None:
    healthy = _replicas((16, [(["0:0", "0:1"], (0, 7)), (["0:2", "0:3"], (7, 14))]))
    fast = client.post("/v1/estimate", json={**_small({}), "layout": {"replicas": healthy}})
    slow = client.post("/v1/estimate", json={**_small({"slow": [{"device": "0:3", "speed": 0.5}]}),
                                             "layout": {"replicas": healthy}})
    assert fast.status_code == slow.status_code == 200, (fast.text, slow.text)
    fast_stages, slow_stages = fast.json()["replicas"][0]["stages"], slow.json()["replicas"][0]["stages"]
    assert slow_stages[0]["forward_ms"] == pytest.approx(fast_stages[0]["forward_ms"])
    assert slow_stages[1]["speed"] == 0.5
    assert slow_stages[1]["forward_ms"] > 1.5 * fast_stages[1]["forward_ms"]
    assert slow.json()["predicted"]["iteration_time_s"] > fast.json()["predicted"]["iteration_time_s"]


@pytest.mark.parametrize(("replicas", "fragments"), [
    (_replicas((16, [(["1:3"], (0, 14))])), ("replica 0 stage 0", "1:3", "failed")),
    (_replicas((8, [(["0:0"], (0, 14))]), (8, [(["0:0"], (0, 14))])), ("replica 1 stage 0", "0:0", "already used")),
    (_replicas((16, [(["0:3", "1:0"], (0, 14))])), ("one node", "0:3", "1:0")),
    (_replicas((16, [(["0:0"], (0, 6)), (["0:1"], (7, 14))])), ("replica 0 stage 1", "start at layer 6")),
    (_replicas((16, [(["0:0"], (0, 13))])), ("replica 0", "end at layer 13", "has 14")),
    (_replicas((15, [(["0:0", "0:1"], (0, 14))])), ("15 sequences", "global_batch_size is 16")),
    (_replicas((16, [(["0:0", "0:1", "0:2"], (0, 14))])), ("tp 3", "32 attention heads")),
    (_replicas((16, [(["2:0"], (0, 14))])), ("2:0", "2 nodes")),
])
def test_an_impossible_replica_layout_is_a_422_naming_the_stage(client, replicas, fragments) -> None:
    response = client.post("/v1/estimate", json=_request({"replicas": replicas}))
    assert_detail(response, *fragments)


def test_a_stage_too_big_for_memory_is_a_422_with_the_numbers(client) -> None:
    response = client.post("/v1/estimate", json=_request({"replicas": _replicas((16, [(["0:0"], (0, 14))])),
                                                          "recompute": "none"}))
    assert_detail(response, "replica 0 stage 0", "14 layers", "GiB per GPU", "A100-40GB")


def test_replicas_and_a_shape_together_are_a_422(client) -> None:
    response = client.post("/v1/estimate", json=_request({"tp": 2, "pp": 1,
                                                          "replicas": _replicas((16, [(["0:0"], (0, 14))]))}))
    assert_validation(response, ("layout",), "either replicas or tp, pp")


def test_a_shape_needs_tp_and_pp(client) -> None:
    assert_validation(client.post("/v1/estimate", json=_request({"micro_batch_size": 1})), ("layout",), "tp and pp")
