"""Malformed or unsatisfiable requests: always 422 with a useful `detail`, never a 500."""

from __future__ import annotations

import json

import pytest

from tests.api.support import assert_detail, assert_validation, small_request

HF_BASE = {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "vocab_size": 1000,
           "intermediate_size": 1024, "hidden_act": "silu"}


def plan(client, body):
    return client.post("/v1/plan", json=body)


def test_unknown_model_preset_lists_known_presets(client):
    detail = assert_detail(plan(client, small_request(model="llama9-1t")), "llama9-1t")
    for name in ("llama2-7b", "llama2-70b", "llama3-405b", "qwen2.5-72b", "gpt3-175b"):
        assert name in detail


def test_unknown_gpu_preset_lists_known_presets(client):
    body = small_request(cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "V100"})
    detail = assert_detail(plan(client, body), "V100")
    for name in ("A100-40GB", "A100-80GB", "H100-SXM", "H200", "B200"):
        assert name in detail


def test_all_presets_named_by_the_contract_exist(client):
    """API.md promises these presets; a 200 or a non-'unknown' 422 shows the name resolves."""
    for gpu in ("A100-40GB", "A100-80GB", "H100-SXM", "H200", "B200"):
        response = plan(client, small_request(cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": gpu}))
        assert response.status_code == 200, (gpu, response.text)
    for model in ("llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b",
                  "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "gpt3-175b"):
        body = small_request(model=model, cluster={"num_nodes": 1, "gpus_per_node": 1, "gpu": "A100-80GB"})
        response = plan(client, body)
        assert response.status_code in (200, 422), response.text
        assert "unknown model preset" not in response.text, model


def test_malformed_failed_device(client):
    response = plan(client, small_request(failures={"failed": ["3-5"]}))
    assert_validation(response, ("failures", "failed"), "'3-5'", '"<node>:<gpu>"')


def test_malformed_slow_device(client):
    response = plan(client, small_request(failures={"slow": [{"device": "1:*", "speed": 0.5}]}))
    assert_validation(response, ("slow", 0, "device"), "'1:*'")


def test_failed_node_out_of_range_names_the_range(client):
    body = small_request(cluster={"num_nodes": 4, "gpus_per_node": 8, "gpu": "A100-80GB"},
                         failures={"failed": ["99:1"]})
    assert_detail(plan(client, body), "'99:1'", "node 99", "0..3")


def test_failed_whole_node_out_of_range(client):
    assert_detail(plan(client, small_request(failures={"failed": ["2:*"]})), "'2:*'", "0..1")


def test_failed_gpu_out_of_range(client):
    assert_detail(plan(client, small_request(failures={"failed": ["0:8"]})), "'0:8'", "GPU 8", "0..7")


def test_slow_device_out_of_range(client):
    body = small_request(failures={"slow": [{"device": "7:0", "speed": 0.5}]})
    assert_detail(plan(client, body), "'7:0'", "0..1")


@pytest.mark.parametrize("speed, message", [
    (0, "greater than or equal to 0.001"), (1.5, "less than or equal to 1"), (-0.5, "greater than or equal to 0.001"),
    (5e-324, "greater than or equal to 0.001"),  # found by fuzzing: the stage times overflowed to inf
])
def test_slow_speed_out_of_range(client, speed, message):
    body = small_request(failures={"slow": [{"device": "0:1", "speed": speed}]})
    assert_validation(plan(client, body), ("slow", 0, "speed"), message)


def test_slow_device_listed_twice_with_different_speeds(client):
    slow = [{"device": "0:1", "speed": 0.5}, {"device": "0:1", "speed": 0.7}]
    assert_detail(plan(client, small_request(failures={"slow": slow})), "'0:1'", "twice")


def test_unknown_top_level_field(client):
    response = plan(client, small_request(clusters={"num_nodes": 1}))
    assert_validation(response, ("clusters",), "Extra inputs are not permitted")


def test_unknown_nested_field(client):
    body = small_request(training={"global_batch_size": 32, "seq_length": 2048, "global_batch": 32})
    assert_validation(plan(client, body), ("training", "global_batch"), "Extra inputs are not permitted")


def test_missing_required_field(client):
    body = small_request()
    del body["training"]
    assert_validation(plan(client, body), ("training",), "Field required")


def test_body_that_is_not_json(client):
    response = client.post("/v1/plan", content=b'{"cluster": ', headers={"content-type": "application/json"})
    assert_detail(response, "not valid JSON", "line 1 column 12")


def test_model_that_cannot_fit(client):
    body = small_request(model="llama3-405b", cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"})
    assert_detail(plan(client, body), "llama3-405b", "TiB", "8 surviving", "A100-80GB", "616 GiB", "3 GiB memory reserve")


def test_model_that_cannot_fit_after_failures(client):
    body = small_request(model="llama3-70b", cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB"},
                         failures={"failed": ["1:*", "0:0"]})
    assert_detail(plan(client, body), "llama3-70b", "TiB", "7 surviving")


def test_all_gpus_failed(client):
    body = small_request(failures={"failed": ["0:*", "1:*"]})
    assert_detail(plan(client, body), "all 16 GPUs", "failed")


def test_micro_batch_not_dividing_global_batch(client):
    body = small_request(training={"global_batch_size": 32, "seq_length": 2048, "micro_batch_size": 5})
    assert_detail(plan(client, body), "global_batch_size 32", "micro_batch_size 5")


def test_hf_config_missing_hidden_size(client):
    config = {k: v for k, v in HF_BASE.items() if k != "hidden_size"}
    assert_detail(plan(client, small_request(model={"hf_config": config})), "hf_config", "hidden_size")


def test_hf_config_missing_vocab_size(client):
    config = {k: v for k, v in HF_BASE.items() if k != "vocab_size"}
    assert_detail(plan(client, small_request(model={"hf_config": config})), "hf_config", "vocab_size")


@pytest.mark.parametrize("value", ["abc", [4], {"a": 1}, -4, 0, 4.7, True])
def test_hf_config_bad_layer_count(client, value):
    config = {**HF_BASE, "num_hidden_layers": value}
    response = plan(client, small_request(model={"hf_config": config}))
    detail = assert_detail(response)
    assert "hf_config" in detail or "num_layers" in detail


def test_hf_config_with_overflowing_number_is_422(client):
    """1e400 is valid JSON (it parses to float inf); an int() overflow must not become a 500."""
    body = json.dumps(small_request(model={"hf_config": HF_BASE})).replace('"num_hidden_layers": 4', '"num_hidden_layers": 1e400')
    assert "1e400" in body
    response = client.post("/v1/plan", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, f"{response.status_code}: {response.text}"
    assert "num_hidden_layers" in response.json()["detail"] or "hf_config" in response.json()["detail"]


def test_hf_config_kv_heads_not_dividing_heads(client):
    config = {**HF_BASE, "num_key_value_heads": 3}
    assert_detail(plan(client, small_request(model={"hf_config": config})), "num_attention_heads 8", "num_kv_heads 3")


def test_architecture_hidden_size_not_divisible_by_heads(client):
    model = {"num_layers": 4, "hidden_size": 1000, "ffn_hidden_size": 4000, "num_attention_heads": 16, "vocab_size": 1000}
    response = plan(client, small_request(model=model))
    assert_validation(response, ("model",), "hidden_size 1000 is not divisible by num_attention_heads 16")


def test_architecture_kv_heads_not_dividing_heads(client):
    model = {"num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 4096, "num_attention_heads": 16,
             "num_kv_heads": 5, "vocab_size": 1000}
    assert_validation(plan(client, small_request(model=model)), ("model",), "num_kv_heads 5")


def test_gpu_object_missing_memory(client):
    body = small_request(cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": {"name": "x", "peak_tflops": 100}})
    assert_validation(plan(client, body), ("cluster", "gpu", "memory_gib"), "Field required")


def test_gpu_too_small_for_the_model(client):
    gpu = {"name": "tiny", "peak_tflops": 100, "memory_gib": 4}
    body = small_request(cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": gpu})
    assert_detail(plan(client, body), "llama2-7b", "8 surviving tiny GPUs")


@pytest.mark.parametrize("field, value", [("num_nodes", 0), ("gpus_per_node", 0), ("gpus_per_node", 73)])
def test_cluster_size_bounds(client, field, value):
    cluster = {"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB", field: value}
    assert_validation(plan(client, small_request(cluster=cluster)), ("cluster", field))


@pytest.mark.parametrize("field, value", [("zero_stage", 4), ("recompute", "sometimes"), ("precision", "fp4"),
                                          ("global_batch_size", 0), ("seq_length", 0)])
def test_training_field_bounds(client, field, value):
    training = {"global_batch_size": 32, "seq_length": 2048, field: value}
    assert_validation(plan(client, small_request(training=training)), ("training", field))


def test_time_limit_must_be_positive(client):
    body = small_request(options={"time_limit_s": 0})
    assert_validation(plan(client, body), ("options", "time_limit_s"), "greater than 0")


def test_no_layout_fits_in_memory_gives_the_numbers(client):
    """Enough total memory for the state, but no layout's fullest GPU fits: the detail carries GiB figures."""
    # 16 x (80 - 3 reserved) GiB hold llama2-70b's 1.13 TiB of state; at 32k tokens no layout's activations fit.
    body = small_request(model="llama2-70b", training={"global_batch_size": 64, "seq_length": 32768})
    detail = assert_detail(plan(client, body), "GiB", "A100-80GB", "77 GiB", "3 GiB memory reserve")
    assert "fits" in detail
