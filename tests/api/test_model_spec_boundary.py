"""Every way of naming a model meets one set of limits at the boundary: a 422 before any solve."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.api.support import small_request
from tests.cost_models.test_model_spec import LLAMA3_8B_CONFIG
from wire.schemas import PlanRequest

MIXTRAL_8X7B_CONFIG = {  # verbatim architecture fields of mistralai/Mixtral-8x7B-v0.1/config.json
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "vocab_size": 32000,
}


def _hf_request(config: dict) -> dict:
    return small_request(model={"hf_config": config})


@pytest.mark.parametrize(
    "config,named",
    [
        ({**LLAMA3_8B_CONFIG, "num_hidden_layers": 1025}, "num_hidden_layers must be a whole number from 1 to 1,024"),
        ({**LLAMA3_8B_CONFIG, "num_hidden_layers": 100_000}, "num_hidden_layers must be a whole number from 1 to"),
        ({**LLAMA3_8B_CONFIG, "_name_or_path": "m" * 129}, "_name_or_path is 129 characters; at most 128"),
        ({**LLAMA3_8B_CONFIG, "hidden_size": 4097}, "hidden_size 4097 is not divisible by num_attention_heads 32"),
        (MIXTRAL_8X7B_CONFIG, "num_local_experts is 8: a mixture-of-experts model"),
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
        (MIXTRAL_8X7B_CONFIG, "num_local_experts is 8"),
    ],
)
def test_the_service_answers_422_naming_the_hf_config_field(client, config, named):
    response = client.post("/v1/plan", json=_hf_request(config))
    assert response.status_code == 422, response.text
    assert named in response.json()["detail"]


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
