"""A calibration says what its runs span (`covers`), and a plan or estimate priced with it names each way it goes
beyond them (`predicted.calibration_extrapolates`)."""

from __future__ import annotations

import json

import pytest

from tests.api.support import estimate_request, small_request
from tests.api.test_calibrations import _rewrite_stored, _runs

LLAMA2_7B_PARAMETERS = 6_738_415_616  # Meta's released checkpoint: 6.74B
LLAMA2_13B_PARAMETERS = 13_015_864_320


def _calibration(client) -> dict:
    response = client.post("/v1/calibrations", json={"name": "lab A100s", "runs": _runs(client)})
    assert response.status_code == 201, response.text
    return response.json()


def test_the_calibration_covers_what_its_runs_span(client):
    covers = _calibration(client)["covers"]
    # The runs (tests.api.test_calibrations.LAYOUTS): llama2-7b and 13b on A100-80GB in bf16, tp 1, 2 and 4,
    # micro-batches of 1 and 2 sequences of 2,048 tokens.
    assert covers["gpus"] == ["A100-80GB"] and covers["precisions"] == ["bf16"]
    assert covers["nvlink_topologies"] == ["switch"]
    assert covers["tp"] == [1, 4] and covers["cp"] == [1, 1] and covers["ep"] == [1, 1]
    assert covers["microbatch_tokens"] == [2048, 4096]
    assert covers["zero_sharding"] == ["none"]  # ZeRO-1 (the default): no per-layer collectives
    low, high = covers["model_parameters"]
    assert abs(low / LLAMA2_7B_PARAMETERS - 1) < 0.01 and abs(high / LLAMA2_13B_PARAMETERS - 1) < 0.01


def test_inside_the_span_nothing_is_named_and_outside_each_way_is(client):
    calibration = _calibration(client)
    options = {"calibration_id": calibration["calibration_id"]}
    inside = estimate_request({"tp": 2, "pp": 2, "micro_batch_size": 1}, training={"global_batch_size": 32,
                                                                                  "seq_length": 2048}, options=options)
    answer = client.post("/v1/estimate", json=inside).json()
    assert answer["predicted"]["calibration_extrapolates"] == []

    outside = estimate_request({"tp": 8, "pp": 4, "micro_batch_size": 2}, model="llama2-70b", options=options)
    named = client.post("/v1/estimate", json=outside).json()["predicted"]["calibration_extrapolates"]
    assert len(named) == 3
    assert named[0].startswith("tp 8:") and "1-4" in named[0]
    assert named[1].startswith("model parameters 69") and "6.74B-13B" in named[1]
    assert named[2].startswith("tokens per microbatch 8,192:") and "2,048-4,096" in named[2]
    shorter = estimate_request({"tp": 2, "pp": 2, "micro_batch_size": 1}, training={"global_batch_size": 32,
                                                                                   "seq_length": 1024}, options=options)
    assert client.post("/v1/estimate", json=shorter).json()["predicted"]["calibration_extrapolates"] == [
        "tokens per microbatch 1,024: the calibration's runs span 2,048-4,096"]

    # The same layout on nodes whose GPUs link directly to each other: the fitted NVLink fraction was a switch's.
    mesh = estimate_request({"tp": 2, "pp": 2, "micro_batch_size": 1}, training={"global_batch_size": 32,
                                                                                "seq_length": 2048}, options=options,
                            cluster={"num_nodes": 4, "gpus_per_node": 8, "gpu": "A100-80GB", "nvlink_topology": "mesh"})
    assert client.post("/v1/estimate", json=mesh).json()["predicted"]["calibration_extrapolates"] == [
        "NVLink topology mesh: the calibration's runs used switch"]

    # Without a calibration a plan names nothing; with one, the plan is checked like an estimate.
    assert client.post("/v1/plan", json=small_request()).json()["predicted"]["calibration_extrapolates"] == []
    h100 = small_request(cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"},
                         options={"time_limit_s": 2, **options})
    plan = client.post("/v1/plan", json=h100).json()
    assert any(line.startswith("GPU H100-SXM: the calibration's runs used A100-80GB")
               for line in plan["predicted"]["calibration_extrapolates"])


def test_a_calibration_stored_without_its_span_gets_it_when_read(client, db_url):
    calibration = _calibration(client)
    earlier = {key: value for key, value in calibration.items() if key != "covers"}
    _rewrite_stored(db_url, "update calibrations set calibration_json = :json where calibration_id = :id",
                    json=json.dumps(earlier), id=calibration["calibration_id"])
    read = client.get(f"/v1/calibrations/{calibration['calibration_id']}").json()
    assert read["covers"] == calibration["covers"]
    assert read["parameters"] == calibration["parameters"] and read["refit"] is None


def test_a_calibration_stored_before_fit_weight_is_read_and_applied_as_stored(client, db_url):
    """Stored before calibrations shrank (its fit taken whole): no fit_weight, and its parameters apply as they are,
    without a refit (the cost model prices its runs as it did)."""
    calibration = _calibration(client)
    earlier = {key: value for key, value in calibration.items() if key != "fit_weight"}
    _rewrite_stored(db_url, "update calibrations set calibration_json = :json where calibration_id = :id",
                    json=json.dumps(earlier), id=calibration["calibration_id"])
    read = client.get(f"/v1/calibrations/{calibration['calibration_id']}").json()
    assert read["fit_weight"] is None and read["parameters"] == calibration["parameters"] and read["refit"] is None
    body = {**_runs(client)[0], "options": {"calibration_id": calibration["calibration_id"]}}
    del body["measured_iteration_time_s"]
    applied = client.post("/v1/estimate", json=body).json()["predicted"]["iteration_time_s"]
    assert applied == pytest.approx(calibration["runs"][0]["predicted_s"], abs=1.01e-6)


@pytest.mark.parametrize("missing", ["nvlink_topologies", "zero_sharding"])
def test_a_span_stored_without_a_later_field_gets_it_when_read(client, db_url, missing):
    calibration = _calibration(client)
    covers = {key: value for key, value in calibration["covers"].items() if key != missing}
    _rewrite_stored(db_url, "update calibrations set calibration_json = :json where calibration_id = :id",
                    json=json.dumps({**calibration, "covers": covers}), id=calibration["calibration_id"])
    read = client.get(f"/v1/calibrations/{calibration['calibration_id']}").json()
    assert read["covers"][missing] is not None and read["covers"] == calibration["covers"]


def _zero3_run(client, nodes: int, model: str) -> dict:
    """ZeRO-3 over every GPU of `nodes` nodes of 8 (tp 1, pp 1), measured 30% slower than predicted."""
    body = estimate_request({"tp": 1, "pp": 1, "micro_batch_size": 1, "recompute": "full"}, model=model,
                            cluster={"num_nodes": nodes, "gpus_per_node": 8, "gpu": "A100-80GB"},
                            training={"global_batch_size": 16 * nodes, "seq_length": 2048, "zero_stage": 3})
    answer = client.post("/v1/estimate", json=body)
    assert answer.status_code == 200, answer.text
    return {**body, "measured_iteration_time_s": round(answer.json()["predicted"]["iteration_time_s"] * 1.3, 6)}


def test_zero3_fitted_inside_a_node_extrapolates_to_sharding_across_nodes(client):
    """shard_overlap_fraction measured over NVLink says little about collectives over the network: a plan that
    shards across nodes says so; one that shards nothing per layer, or only inside nodes, does not."""
    runs = [_zero3_run(client, 1, "llama2-7b"), _zero3_run(client, 1, "llama2-13b")]
    response = client.post("/v1/calibrations", json={"name": "one-node FSDP", "runs": runs})
    assert response.status_code == 201, response.text
    calibration = response.json()
    assert calibration["covers"]["zero_sharding"] == ["within a node"]
    options = {"calibration_id": calibration["calibration_id"]}

    def named(layout: dict, zero_stage: int) -> list[str]:
        body = estimate_request(layout, options=options, cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB"},
                                training={"global_batch_size": 32, "seq_length": 2048, "zero_stage": zero_stage})
        answer = client.post("/v1/estimate", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["predicted"]["calibration_extrapolates"]

    full = {"tp": 1, "pp": 1, "micro_batch_size": 1, "recompute": "full"}
    assert named(full, 3) == ["ZeRO-2/3 sharding across nodes: the calibration's runs sharded within a node"]
    assert named(full, 1) == []  # ZeRO-1 runs no per-layer collectives
    assert named({**full, "dp_shard": 8}, 3) == []  # hybrid: each shard group fills one node
    # 8 replicas of tp 2 to a shard group: 16 GPUs, two nodes (and a TP degree the runs did not have)
    assert named({**full, "tp": 2, "dp_shard": 8}, 3) == [
        "tp 2: the calibration's runs span 1", "ZeRO-2/3 sharding across nodes: the calibration's runs sharded within a node"]
