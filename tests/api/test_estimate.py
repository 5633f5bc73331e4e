"""POST /v1/estimate: one fixed layout, no search."""

from __future__ import annotations

from tests.api.support import (
    assert_detail,
    assert_validation,
    estimate_request,
    stage_devices,
    verify_plan,
)


def post_estimate(client, body):
    response = client.post("/v1/estimate", json=body)
    assert response.status_code == 200, response.text
    return verify_plan(response.json(), body)


def test_tp2_pp2_layout_is_reflected_exactly(client):
    body = estimate_request({"tp": 2, "pp": 2, "micro_batch_size": 1, "virtual_stages": 1,
                             "schedule": "1f1b", "recompute": "selective"})
    plan = post_estimate(client, body)
    assert plan.uniform is True
    assert plan.micro_batch_size == 1
    assert plan.schedule == "1f1b"
    assert plan.virtual_stages == 1
    assert plan.recompute == "selective"
    # 32 healthy GPUs / (tp 2 x pp 2) = 8 replicas, 256 / 8 = 32 microbatches each.
    assert len(plan.replicas) == 8
    assert plan.unused_devices == [] and plan.excluded_devices == []
    for replica in plan.replicas:
        assert replica.num_microbatches == 32
        assert [stage.tp for stage in replica.stages] == [2, 2]
        assert [tuple(stage.layers) for stage in replica.stages] == [(0, 16), (16, 32)]


def test_explicit_dp_leaves_the_rest_unused(client):
    body = estimate_request({"tp": 2, "pp": 2, "dp": 2})
    plan = post_estimate(client, body)
    assert len(plan.replicas) == 2
    assert all(replica.num_microbatches == 128 for replica in plan.replicas)
    assert len(stage_devices(plan)) == 8
    assert len(plan.unused_devices) == 24


def test_uneven_layers_per_stage_is_accepted(client):
    body = estimate_request({"tp": 2, "pp": 2, "layers_per_stage": [10, 22]})
    plan = post_estimate(client, body)
    for replica in plan.replicas:
        assert [tuple(stage.layers) for stage in replica.stages] == [(0, 10), (10, 32)]
    first = plan.replicas[0].stages
    assert first[1].forward_ms > first[0].forward_ms  # 22 layers take longer than 10


def test_uneven_pp_with_layers_per_stage(client):
    body = estimate_request({"tp": 2, "pp": 3, "layers_per_stage": [10, 11, 11]})
    plan = post_estimate(client, body)
    assert [tuple(s.layers) for s in plan.replicas[0].stages] == [(0, 10), (10, 21), (21, 32)]


def test_interleaved_schedule(client):
    body = estimate_request({"tp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2})
    plan = post_estimate(client, body)
    assert plan.schedule == "interleaved"
    assert plan.virtual_stages == 2


def test_estimate_excludes_failed_devices(client):
    body = estimate_request({"tp": 2, "pp": 2}, failures={"failed": ["0:3", "3:*"], "slow": [{"device": "1:0", "speed": 0.5}]})
    plan = post_estimate(client, body)
    assert plan.uniform is True
    used = set(stage_devices(plan))
    assert "0:3" not in used and not any(device.startswith("3:") for device in used)
    assert len(plan.excluded_devices) == 9


def test_tp_not_dividing_heads(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 3, "pp": 2}))
    assert_detail(response, "tp 3", "32 attention heads")


def test_tp_larger_than_a_node(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 16, "pp": 1}))
    assert_detail(response, "tp 16", "gpus_per_node 8")


def test_pp_not_dividing_layers(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 3}))
    assert_detail(response, "pp 3", "num_layers 32", "layers_per_stage")


def test_pp_exceeding_layers(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 1, "pp": 64}))
    assert_detail(response, "pp 64", "32 layers")


def test_layers_per_stage_not_summing(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "layers_per_stage": [10, 20]}))
    assert_detail(response, "[10, 20]", "num_layers=32")


def test_layers_per_stage_wrong_length(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "layers_per_stage": [32]}))
    assert_detail(response, "[32]", "pp=2")


def test_layers_per_stage_with_an_empty_stage(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "layers_per_stage": [0, 32]}))
    assert_detail(response, "[0, 32]", "positive")


def test_layout_that_does_not_fit_memory(client):
    layout = {"tp": 1, "pp": 1, "micro_batch_size": 16, "recompute": "none"}
    response = client.post("/v1/estimate", json=estimate_request(layout))
    detail = assert_detail(response, "GiB", "A100-80GB", "80 GiB")
    assert "stage 0" in detail


def test_interleaved_with_one_virtual_stage(client):
    layout = {"tp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 1}
    response = client.post("/v1/estimate", json=estimate_request(layout))
    assert_detail(response, "interleaved", "virtual_stages")


def test_1f1b_with_virtual_stages(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "virtual_stages": 2}))
    assert_detail(response, "1f1b", "virtual_stages")


def test_global_batch_not_divisible_by_dp_times_micro_batch(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "dp": 3}))
    assert_detail(response, "global_batch_size 256", "dp 3", "micro_batch_size 1")


def test_micro_batch_not_dividing_global_batch(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "micro_batch_size": 3}))
    assert_detail(response, "global_batch_size 256", "micro_batch_size 3")


def test_dp_larger_than_the_cluster(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "dp": 16}))
    assert_detail(response, "dp 16", "the cluster has 16")


def test_all_failed_estimate(client):
    failed = [f"{n}:*" for n in range(4)]
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2}, failures={"failed": failed}))
    assert_detail(response, "the cluster has 0")


def test_estimate_needs_a_layout(client):
    body = estimate_request({"tp": 2, "pp": 2})
    del body["layout"]
    assert_validation(client.post("/v1/estimate", json=body), ("layout",), "Field required")


def test_layout_recompute_auto_is_rejected(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "recompute": "auto"}))
    assert_validation(response, ("layout", "recompute"), "selective")


def test_layout_unknown_field(client):
    response = client.post("/v1/estimate", json=estimate_request({"tp": 2, "pp": 2, "dpp": 2}))
    assert_validation(response, ("layout", "dpp"), "Extra inputs are not permitted")
