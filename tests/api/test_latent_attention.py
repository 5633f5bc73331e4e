"""DeepSeek-style models over the wire: latent attention and dense layers among the experts planned, estimated
and refused in the user's terms."""

from __future__ import annotations

import pytest

from cost_models.expert_parallel import layer_params_per_gpu
from tests.api.support import verify_plan
from wire.convert import resolve_model
from wire.schemas import PlanRequest

GIB = 2**30
H100S = {"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM"}
TRAINING = {"global_batch_size": 256, "seq_length": 4096}
# DeepSeek-V2-Lite's shape written out (its config.json): latent attention without a query latent, the first
# layer dense, 64 routed experts of 1408 (top 6) and two shared ones
V2_LITE = {"name": "v2-lite", "num_layers": 27, "hidden_size": 2048, "ffn_hidden_size": 1408, "num_attention_heads": 16,
           "head_dim": 128, "vocab_size": 102400, "norm_epsilon": 1e-6, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "num_experts": 64, "experts_per_token": 6, "shared_expert_ffn_hidden_size": 2816,
           "dense_layers": 1, "dense_ffn_hidden_size": 10944}


def test_deepseek_v2_lite_is_planned_with_expert_parallelism_and_every_stage_holds_its_layers(client):
    request = {"cluster": H100S, "model": V2_LITE, "training": TRAINING, "options": {"time_limit_s": 10}}
    response = client.post("/v1/plan", json=request)
    assert response.status_code == 200, response.text
    plan = verify_plan(response.json(), request)
    assert plan.ep > 1 and plan.predicted.breakdown.ep_comm_s > 0
    assert plan.architecture.kv_lora_rank == 512 and plan.architecture.dense_layers == 1
    model = resolve_model(PlanRequest.model_validate(request).model)
    assert model.total_params == resolve_model("deepseek-v2-lite").total_params
    for replica in plan.replicas:
        for stage in replica.stages:
            layers = stage.layers[1] - stage.layers[0]
            held = layers * layer_params_per_gpu(model, stage.tp, plan.ep, plan.etp) * (2 + 4)  # bf16 weights, fp32 grads
            assert stage.static_memory_gib * GIB >= held


def test_deepseek_v3_is_planned_on_1024_h100s_within_memory(client):
    request = {"cluster": {"num_nodes": 128, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": "deepseek-v3",
               "training": {"global_batch_size": 2048, "seq_length": 4096}, "options": {"time_limit_s": 10}}
    response = client.post("/v1/plan", json=request)
    assert response.status_code == 200, response.text
    plan = verify_plan(response.json(), request)  # invariant 5: every stage within the GPU less the reserve
    assert plan.ep > 1 and len(plan.replicas[0].stages) > 1
    assert 0 < plan.predicted.mfu < 0.6


@pytest.mark.parametrize(("changes", "named"), [
    ({"head_dim": None}, "head_dim (each head's qk_nope_head_dim) is required"),
    ({"qk_rope_head_dim": 0}, "qk_rope_head_dim must be at least 1"),
    ({"num_kv_heads": 4}, "num_kv_heads must equal num_attention_heads"),
    ({"qk_norm": True}, "qkv_bias, linear_bias and qk_norm are not modelled with it"),
    ({"kv_lora_rank": 0}, "give kv_lora_rank too"),
    ({"dense_layers": 27}, "dense_layers must be from 1 to num_layers - 1 (26)"),
    ({"dense_ffn_hidden_size": 0}, "with dense_ffn_hidden_size at least 1"),
    ({"num_experts": 0, "experts_per_token": 0, "shared_expert_ffn_hidden_size": 0}, "give num_experts too"),
    ({"rope_scaling": {"factor": 8.0, "mscale": 1.0}}, "mscale and mscale_all_dim are YaRN's"),
])
def test_a_latent_attention_model_that_cannot_exist_is_a_422_naming_the_field(client, changes, named):
    request = {"cluster": H100S, "model": {**V2_LITE, **changes}, "training": TRAINING}
    response = client.post("/v1/plan", json=request)
    assert response.status_code == 422, response.text
    assert named in response.text
