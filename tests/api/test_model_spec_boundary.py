"""Every way of naming a model meets one set of limits at the boundary: a 422 before any solve."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.api.support import estimate_request, small_request
from tests.cost_models.test_model_spec import (
    DEEPSEEK_V2_LITE_CONFIG,
    DEEPSEEK_V3_CONFIG,
    LLAMA3_8B_CONFIG,
    MIXTRAL_8X7B_CONFIG,
)
from wire.schemas import PlanRequest


def _hf_request(config: dict) -> dict:
    return small_request(model={"hf_config": config})


@pytest.mark.parametrize(
    "config,named",
    [
        ({**LLAMA3_8B_CONFIG, "num_hidden_layers": 1025}, "num_hidden_layers must be a whole number from 1 to 1,024"),
        ({**LLAMA3_8B_CONFIG, "num_hidden_layers": 100_000}, "num_hidden_layers must be a whole number from 1 to"),
        ({**LLAMA3_8B_CONFIG, "_name_or_path": "m" * 129}, "_name_or_path is 129 characters; at most 128"),
        ({**LLAMA3_8B_CONFIG, "hidden_size": 4097}, "hidden_size 4097 is not divisible by num_attention_heads 32"),
        ({**LLAMA3_8B_CONFIG, "kv_lora_rank": 512}, "kv_lora_rank is 512: multi-head latent attention (DeepSeek-V2/V3's"),
        ({**DEEPSEEK_V3_CONFIG, "first_k_dense_replace": 61}, "dense_layers must be from 1 to num_layers - 1 (60)"),
        ({**MIXTRAL_8X7B_CONFIG, "first_k_dense_replace": 1}, "first_k_dense_replace is 1: dense MLP layers"),
        ({**LLAMA3_8B_CONFIG, "num_local_experts": 8}, "num_local_experts is 8: a mixture-of-experts field"),
        ({**MIXTRAL_8X7B_CONFIG, "num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds num_local_experts 8"),
    ],
)
def test_hf_config_is_refused_while_the_request_validates(config, named):
    with pytest.raises(ValidationError) as refused:
        PlanRequest.model_validate(_hf_request(config))
    assert named in str(refused.value)


@pytest.mark.parametrize(
    "config,named",
    [
        ({**LLAMA3_8B_CONFIG, "num_hidden_layers": 100_000}, "num_hidden_layers"),
        ({**LLAMA3_8B_CONFIG, "_name_or_path": "m" * 200}, "_name_or_path is 200 characters"),
        ({**MIXTRAL_8X7B_CONFIG, "kv_lora_rank": 512}, "kv_lora_rank is 512: multi-head latent attention"),
        ({**DEEPSEEK_V3_CONFIG, "kv_lora_rank": None, "q_lora_rank": None}, "has none of kv_lora_rank"),
    ],
)
def test_the_service_answers_422_naming_the_hf_config_field(client, config, named):
    response = client.post("/v1/plan", json=_hf_request(config))
    assert response.status_code == 422, response.text
    assert named in response.json()["detail"]


def test_deepseek_v2_lite_estimates_alike_by_preset_and_by_hf_config(client):
    """The config.json and the preset are one model: the same prediction for the same layout."""
    answers = []
    for model in ("deepseek-v2-lite", {"hf_config": DEEPSEEK_V2_LITE_CONFIG}):
        body = estimate_request({"tp": 1, "pp": 1, "dp": 32, "ep": 8}, model=model)
        response = client.post("/v1/estimate", json=body)
        assert response.status_code == 200, response.text
        answers.append(response.json()["predicted"]["iteration_time_s"])
    assert answers[0] == answers[1] > 0


@pytest.mark.parametrize("model", ["mixtral-8x7b", {"hf_config": MIXTRAL_8X7B_CONFIG}])
def test_mixtral_is_planned_by_preset_and_by_hf_config(client, model):
    response = client.post("/v1/plan", json=small_request(model=model))
    assert response.status_code == 200, response.text
    plan = response.json()
    assert plan["status"] in ("optimal", "feasible")
    assert sum(stage["layers"][1] - stage["layers"][0] for stage in plan["replicas"][0]["stages"]) == 32


def _estimate(client, model) -> dict:
    response = client.post("/v1/estimate", json=estimate_request({"tp": 8, "pp": 4, "dp": 1}, model=model))
    assert response.status_code == 200, response.text
    return response.json()


def test_mixtral_estimates_alike_by_preset_and_hf_config_and_carries_its_experts(client):
    preset, from_hf = _estimate(client, "mixtral-8x7b"), _estimate(client, {"hf_config": MIXTRAL_8X7B_CONFIG})
    assert preset["predicted"] == from_hf["predicted"]
    assert [stage["static_memory_gib"] for stage in preset["replicas"][0]["stages"]] == [
        stage["static_memory_gib"] for stage in from_hf["replicas"][0]["stages"]]
    # Llama 3 8B has Mixtral's layer shape with one dense MLP (and a 4x larger vocabulary): Mixtral's eight
    # experts a layer make a middle stage's weights several times larger, so the experts crossed the wire
    dense = _estimate(client, "llama3-8b")
    assert preset["replicas"][0]["stages"][1]["static_memory_gib"] > 4 * dense["replicas"][0]["stages"][1][
        "static_memory_gib"]


def test_architecture_object_and_stored_architecture_meet_the_same_limits():
    body = small_request(model={"num_layers": 1025, "hidden_size": 256, "ffn_hidden_size": 512,
                                "num_attention_heads": 4, "vocab_size": 1000})
    with pytest.raises(ValidationError, match="less than or equal to 1024"):
        PlanRequest.model_validate(body)


def test_learned_positions_need_a_table_size():
    body = small_request(model={"num_layers": 2, "hidden_size": 256, "ffn_hidden_size": 512, "num_attention_heads": 4,
                                "vocab_size": 1000, "position_embedding": "learned"})
    with pytest.raises(ValidationError, match="position_embedding learned needs max_position_embeddings"):
        PlanRequest.model_validate(body)


def test_old_requests_keep_their_meaning():
    """An architecture without the new fields is what resiplan assumed before: RMSNorm, RoPE 10000, no biases."""
    body = small_request(model={"num_layers": 2, "hidden_size": 256, "ffn_hidden_size": 512, "num_attention_heads": 4,
                                "vocab_size": 1000})
    model = PlanRequest.model_validate(body).model
    assert (model.normalization, model.position_embedding, model.rope_theta, model.rope_scaling) == (
        "rmsnorm", "rope", 10_000.0, None)
    assert not model.qkv_bias and not model.linear_bias
